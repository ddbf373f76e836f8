"""A hybrid model under vLLM's real v1 Scheduler (kvfuzz.scheduler, docs/scheduler-models.md#hybrid-models): a Gemma 2
whose layers alternate a sliding window and full attention, two KV-cache groups that vLLM's own planner builds over
one pool. The unmodified scheduler passes with the sliding-window group's drops reached; the worker's per-group
tables follow vLLM's; and each seeded bug of the sliding-window manager is caught, with its message.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm_versions import V1_RUNNER, v2_alone

from kvfuzz.cli import main
from kvfuzz.scheduler.async_batches import BatchQueue
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.fake_model import expected_output
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.trace import load
from kvfuzz.scheduler.vllm_build import kv_cache_config

HYBRID = SchedulerSetup(num_blocks=16, model="sliding-window")  # window 8 tokens, blocks of 4
HYBRID_ARGS = ["--scheduler", "vllm-v1", "--model", "sliding-window", "--num-blocks", "16"]


def test_vllm_plans_a_sliding_window_group_beside_a_full_attention_group_in_one_pool() -> None:
    config = kv_cache_config(HYBRID)
    assert config.num_blocks == HYBRID.num_blocks + 1  # the pool, and vLLM's null block
    specs = sorted(type(group.kv_cache_spec).__name__ for group in config.kv_cache_groups)
    assert specs == [FullAttentionSpec.__name__, SlidingWindowSpec.__name__]
    (sliding,) = [g.kv_cache_spec for g in config.kv_cache_groups if isinstance(g.kv_cache_spec, SlidingWindowSpec)]
    assert sliding.sliding_window == 8
    session = Session(HYBRID)
    assert type(session.scheduler.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    assert sorted(rule.window or 0 for rule in session.worker.groups) == [0, 8]
    # vLLM's startup check admits the longest request: 9 blocks of full attention, 6 of the window, 1 spare
    assert HYBRID.max_model_len == 36


def test_a_long_request_s_out_of_window_blocks_are_dropped_and_it_still_passes() -> None:
    """A request of 30 tokens: the sliding-window group frees the blocks behind its window while it runs (vLLM's
    table nulls them), the worker's table keeps their stale ids as the model runner does and needs them no more,
    and the output and every check pass; once drained every block is free."""
    session = Session(HYBRID)
    request = session.add([1, 2, 3, 0] * 5, 10)
    sliding = next(rule.index for rule in session.worker.groups if rule.window is not None)
    manager = session.scheduler.kv_cache_manager.coordinator.single_type_managers[sliding]
    nulled, released = 0, 0
    while request in session.outputs.unfinished():
        session.step()
        blocks = manager.req_to_blocks.get(request, [])
        nulled = max(nulled, sum(block.is_null for block in blocks))
        released = max(released, sum(len(table) for table in session.worker.holdings()[1].values()))
    assert nulled >= 4 and released >= 4, (nulled, released)
    assert session.outputs.requests[request].received == expected_output(request, 20, 10)
    session.drain()
    assert session.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == HYBRID.num_blocks


def test_the_unmodified_scheduler_passes_with_two_groups() -> None:
    outcome = search(HYBRID, examples=20, steps=30, shrink=False)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0 and outcome.hit_tokens > 0, outcome.describe()


def test_the_v1_model_runner_s_protocol_with_two_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the V1 model runner a preempted request resumes among the cached ones with a new table per group."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    setup = SchedulerSetup(num_blocks=12, model="sliding-window")
    if not V1_RUNNER:  # vLLM 0.34.0 removed Model Runner V1: asking for it gets V2's protocol
        return v2_alone(setup)
    outcome = search(setup, examples=15, steps=30, shrink=False)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0, outcome.describe()


def frees_one_block_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded: the sliding-window manager counts a block more as skipped, freeing the block that holds the start of
    the window while the request still attends it."""

    def skipped(self: Any, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1 + self.block_size)

    monkeypatch.setattr(SlidingWindowManager, "get_num_skipped_tokens", skipped)


def test_accounting_catches_a_block_freed_while_still_inside_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    frees_one_block_early(monkeypatch)
    outcome = search(HYBRID, examples=30, steps=30, shrink=False)
    assert outcome.failure is not None and outcome.failure.check.value == "accounting", outcome.explanation()
    assert re.search(
        r"block \d+ is held by the tables of 1 running request\(s\) \['r\d+'\] \(expected ref_cnt 1, not free\), "
        r"but the manager's block is in the free queue",
        outcome.explanation(),
    ), outcome.explanation()


def test_content_catches_a_hit_that_nulls_a_block_inside_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded: a sliding-window prefix hit that needs one contiguous cached block fewer than the window spans, so
    the hit hands the request the null block where its window still reads."""
    original = SlidingWindowManager._contiguous_blocks_for_hit.__func__  # type: ignore[attr-defined]

    def fewer(cls: Any, *args: Any, **kwargs: Any) -> int:
        return max(1, original(cls, *args, **kwargs) - 1)

    monkeypatch.setattr(SlidingWindowManager, "_contiguous_blocks_for_hit", classmethod(fewer))
    outcome = search(HYBRID, examples=30, steps=30, shrink=False)
    assert outcome.failure is not None and outcome.failure.check.value == "content", outcome.explanation()
    assert re.search(
        r"position \d+ maps to vLLM's null block 0 in group \d \(sliding window of 8 tokens\) \(table \[[0-9, ]+\]\), "
        r"but the request still attends it",
        outcome.explanation(),
    ), outcome.explanation()


HYBRID_ASYNC = SchedulerSetup(num_blocks=8, model="sliding-window", async_scheduling=True)


def test_under_async_the_longest_request_leaves_room_for_two_batches_in_flight() -> None:
    """vLLM's startup check reserves, for a sliding-window group, blocks for the tokens of every batch in flight
    (``max_in_flight_tokens``: twice the budget under async scheduling), so on 16 blocks the longest request is 28
    tokens under async (vLLM's own estimate when given 36) against 36 synchronously; the scheduler builds."""
    setup = SchedulerSetup(num_blocks=16, model="sliding-window", async_scheduling=True)
    assert (setup.max_in_flight_tokens, setup.max_model_len, HYBRID.max_model_len) == (32, 28, 36)
    session = Session(setup)
    assert session.scheduler.vllm_config.max_in_flight_tokens == 32


def test_the_unmodified_async_scheduler_passes_with_two_groups_and_reaches_released_rewrites() -> None:
    outcome = search(HYBRID_ASYNC, examples=20, steps=30, shrink=False)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0 and outcome.rewrites > 0, outcome.describe()


def test_under_async_released_reads_every_group_s_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device that orders nothing, with two groups: a block released while a step in flight reads it, in either
    group, and rewritten by the next step, is named."""
    monkeypatch.setattr(BatchQueue, "ordered", lambda self, reader, writer: False)
    outcome = search(HYBRID_ASYNC, examples=30, steps=30)
    assert outcome.check() == "released", outcome.describe()
    assert "released (no table of theirs holds it now) while step" in outcome.explanation()


def test_under_async_a_block_freed_inside_the_window_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeded early free under async scheduling: the scheduler's next output hands the request a table whose
    entry inside the window is vLLM's null block (its manager nulled the block it freed), which the content check
    names before the accounting check would see the block free."""
    frees_one_block_early(monkeypatch)
    outcome = search(HYBRID_ASYNC, examples=40, steps=30, shrink=False)
    assert outcome.check() == "content", outcome.describe()
    assert re.search(
        r"position \d+ maps to vLLM's null block 0 in group \d \(sliding window of 8 tokens\) \(table \[[0-9, ]+\]\), "
        r"but the request still attends it",
        outcome.explanation(),
    ), outcome.explanation()


def test_the_cli_option_the_trace_and_its_replay(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["run", "--model", "sliding-window"]) == 2
    assert capsys.readouterr().err.splitlines() == ["kvfuzz: --model needs --scheduler"]
    assert main(["run", *HYBRID_ARGS, "--examples", "3", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["failed"] is False and summary["steps"] > 0
    frees_one_block_early(monkeypatch)
    corpus = tmp_path / "corpus"
    assert main(["run", *HYBRID_ARGS, "--examples", "30", "--no-shrink", "--corpus", str(corpus)]) == 1
    out = capsys.readouterr().out
    assert "model sliding-window: a four-layer Gemma 2" in out
    (path,) = corpus.glob("*.json")
    assert json.loads(path.read_text())["config"]["model"] == "sliding-window"
    assert load(path).setup == HYBRID
    assert main(["replay", str(path)]) == 1  # reproduced
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["replay", str(path)]) == 0  # gone without the bug
