"""``kvfuzz campaign --scheduler sglang`` without SGLang: its swarm table (every field of the setup, only what the
SGLang target takes) and its refusals. The campaign itself runs in SGLang's environment
(engine_tests/test_sglang_scheduler_traces.py)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import attrs
import pytest

from kvfuzz.cli import main
from kvfuzz.scheduler import swarm
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.sglang.command import setup_problem
from kvfuzz.scheduler.sglang.swarm import SGLANG_DIMENSIONS


def _valid(setup: SchedulerSetup, runner: str) -> None:
    problem = setup_problem(setup)
    if problem is not None:
        raise ValueError(problem)


def test_sglang_s_table_has_a_row_for_every_row_of_vllm_s() -> None:
    assert sorted(dimension.name for dimension in SGLANG_DIMENSIONS) == sorted(
        dimension.name for dimension in swarm.DIMENSIONS
    )
    assert {field.name for field in attrs.fields(SchedulerSetup)} <= {d.name for d in SGLANG_DIMENSIONS}


def test_sglang_s_draws_are_what_its_target_runs_and_vary() -> None:
    rng = random.Random(3)
    configs = [swarm.draw(rng, _valid, SGLANG_DIMENSIONS) for _ in range(60)]
    for config in configs:
        setup = config.setup
        assert setup.block_size >= 2 and setup.max_num_batched_tokens % setup.block_size == 0
        assert (setup.policy, setup.model, setup.async_scheduling, setup.speculative_tokens) == (
            "fcfs",
            "full",
            False,
            0,
        )
        assert not setup.cache_salts and not setup.stop_tokens and config.model_runner == ""
        assert "model runner" not in config.describe()
    assert len({config.setup for config in configs}) > 30 and {c.setup.prefix_caching for c in configs} == {True, False}
    assert sum(config.refused for config in configs) > 0  # budgets not a multiple of the page are redrawn
    assert {c.setup.eos for c in configs} == {True, False}  # requests that end at EOS, half the batches
    assert {c.setup.schedule_conservativeness for c in configs} == {1.0, 0.3, 0.1}  # the adder's overcommit


def test_a_token_budget_sglang_refuses_is_refused_in_one_line() -> None:
    assert setup_problem(SchedulerSetup(block_size=2, max_num_batched_tokens=1)) == (
        "--scheduler sglang needs --max-num-batched-tokens (1) divisible by --block-size (2): SGLang's server "
        "arguments refuse a chunked_prefill_size that is not"
    )
    assert setup_problem(SchedulerSetup(block_size=4, max_num_batched_tokens=16)) is None


NO_SGLANG = (
    "kvfuzz: --scheduler sglang needs SGLang (tested: 0.5.22 and 0.5.23), which is not installed here; build its "
    "environment with scripts/third_party_env.sh sglang@VERSION"
)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_without_sglang_the_campaign_is_refused_in_one_line_exit_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "c"
    assert main(["campaign", "--scheduler", "sglang", "--corpus", str(corpus), "--isolate"]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [NO_SGLANG] and captured.out == ""
    assert not corpus.exists()
