"""``kvfuzz campaign --scheduler vllm-v1 --pin ROW=VALUE`` without vLLM: each row's domain is what it draws, a pin is
checked against it (one line and exit status 2 before any work otherwise), every batch of a pinned campaign draws the
pinned values, and the --json output, the summary and the rerun command record the pins. The real scheduler's pinned
campaign is tested in engine_tests/test_vllm_scheduler_campaign.py."""

from __future__ import annotations

import json
import random
import shlex
from pathlib import Path
from typing import Any

import pytest
from test_scheduler_campaign import FakeTarget

from kvfuzz.scheduler import swarm
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.swarm_table import PinRefused, parse_pins, pin_arguments

TABLE = swarm.DIMENSIONS


def accept(setup: SchedulerSetup, runner: str) -> None:
    pass


def test_each_row_draws_exactly_its_domain() -> None:
    rng = random.Random(0)
    drawn: dict[str, set[Any]] = {row.name: set() for row in swarm.DIMENSIONS}
    for _ in range(3000):
        for row in swarm.DIMENSIONS:
            drawn[row.name].add(row.draw(rng, row.domain))
    for row in swarm.DIMENSIONS:
        assert drawn[row.name] == set(row.domain), row.name


def test_pins_parse_against_the_rows_domains() -> None:
    assert parse_pins(["async_scheduling=true", "speculative_tokens=2", "model=sliding-window"], TABLE) == (
        ("async_scheduling", True),
        ("speculative_tokens", 2),
        ("model", "sliding-window"),
    )
    assert parse_pins(["prefix_caching=False", "model_runner=v2"], TABLE) == (
        ("prefix_caching", False),
        ("model_runner", "V2"),
    )
    pins = parse_pins(["num_blocks=3", "policy=priority", "cache_salts=true"], TABLE)
    assert parse_pins(pin_arguments(pins)[1::2], TABLE) == pins  # the rerun's arguments pin the same values again


@pytest.mark.parametrize(
    "texts, line",
    [
        (
            ["async=true"],
            "--pin async=true: no swarm row 'async'; the rows: num_blocks, block_size, max_num_batched_tokens, "
            "max_num_seqs, prefix_caching, policy, model, async_scheduling, speculative_tokens, cache_salts, "
            "stop_tokens, eos, min_tokens, kv_connector, transfer_delay, load_failures, max_loras, prefix_resets, "
            "kv_events, overlong_requests, stats, prefix_match_unit, sessions, schedule_conservativeness, "
            "model_runner, drafter, kv_events_full",
        ),
        (["speculative_tokens=3"], "--pin speculative_tokens=3: speculative_tokens takes one of 0, 1, 2, 4"),
        (["async_scheduling=yes"], "--pin async_scheduling=yes: async_scheduling takes one of false, true"),
        (["model=hybrid"], "--pin model=hybrid: model takes one of full, sliding-window, mamba-hybrid"),
        (["block_size"], "--pin block_size: expected ROW=VALUE; the rows: "),
        (["block_size=4", "block_size=8"], "--pin block_size=8: block_size is pinned twice"),
    ],
)
def test_a_bad_pin_is_refused_in_one_line(texts: list[str], line: str) -> None:
    with pytest.raises(PinRefused) as refused:
        parse_pins(texts, TABLE)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)
    if "the rows: " in line:
        assert str(refused.value).endswith(
            "model_runner, drafter, kv_events_full, long_prefill_token_threshold, "
            "long_prefill_token_threshold_adaptive, max_num_active_seqs, prefill_schedule_interval, pauses, "
            "load_failure_policy, skip_prefix_reads, retention, chunked_prefill, mamba_checkpoints"
        )


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["--pin", "speculative_tokens=3"],
            "kvfuzz: --pin speculative_tokens=3: speculative_tokens takes one of 0, 1, 2, 4",
        ),
        (["--pin", "nothing=1"], "kvfuzz: --pin nothing=1: no swarm row 'nothing'; the rows: num_blocks,"),
    ],
)
def test_the_cli_refuses_a_bad_pin_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], line: str
) -> None:
    from kvfuzz.cli import main

    monkeypatch.chdir(tmp_path)
    status = main(["campaign", "--scheduler", "vllm-v1", "--max-examples", "5", *args])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    [error] = captured.err.splitlines()
    assert error.startswith(line), error
    assert not list(tmp_path.iterdir()), "a refused campaign leaves nothing behind"


def test_a_scheduler_row_is_no_row_of_an_allocator_campaign(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfuzz.cli import main

    assert main(["campaign", "--pin", "async_scheduling=true"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "kvfuzz: --pin async_scheduling=true: no swarm row 'async_scheduling'; the rows: num_blocks, block_size, "
        "host_blocks, program_length, operations, window"
    ]


def test_sglang_pins_are_checked_against_sglangs_own_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SGLang's table draws schedule_conservativeness, which vLLM's holds at 1.0, and holds async scheduling off:
    its pins are read against its own rows (they were read against vLLM's, which refused the one and took the
    other)."""
    from kvfuzz.cli import _parser
    from kvfuzz.commands.scheduler_campaign import usage_error

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("kvfuzz.scheduler.engines.engine_problem", lambda name, untested: None)
    parse = _parser().parse_args
    base = ["campaign", "--scheduler", "sglang", "--max-examples", "5"]
    assert usage_error(parse([*base, "--pin", "schedule_conservativeness=0.3"])) is None
    assert usage_error(parse([*base, "--pin", "async_scheduling=true"])) == (
        "--pin async_scheduling=true: async_scheduling takes one of false"
    )
    vllm = ["campaign", "--scheduler", "vllm-v1", "--max-examples", "5"]
    assert usage_error(parse([*vllm, "--pin", "async_scheduling=true"])) is None
    assert usage_error(parse([*vllm, "--pin", "schedule_conservativeness=0.3"])) == (
        "--pin schedule_conservativeness=0.3: schedule_conservativeness takes one of 1.0"
    )


def test_a_pinned_draw_holds_the_row_and_draws_the_others() -> None:
    pins = {"async_scheduling": True, "speculative_tokens": 0, "model_runner": "V1"}
    draws = [swarm.draw(random.Random(seed), accept, pins=pins) for seed in range(200)]
    assert all(d.setup.async_scheduling and d.setup.speculative_tokens == 0 for d in draws)
    assert {d.model_runner for d in draws} == {"V1"}
    assert {d.setup.prefix_caching for d in draws} == {True, False} and len({d.setup.num_blocks for d in draws}) > 3
    # a pinned row's draw is still made: where neither draw was refused, the other rows draw what they would unpinned
    pairs = [
        (swarm.draw(random.Random(seed), accept, pins=pins), swarm.draw(random.Random(seed), accept))
        for seed in range(150)
    ]
    same = [(pinned, free) for pinned, free in pairs if pinned.refused == free.refused == 0]
    assert len(same) > 10
    assert all(
        (pinned.setup.num_blocks, pinned.setup.policy, pinned.steps)
        == (free.setup.num_blocks, free.setup.policy, free.steps)
        for pinned, free in same
    )


def test_a_pinned_campaign_runs_every_batch_pinned_and_records_the_pins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfuzz.cli import _parser
    from kvfuzz.commands.scheduler_campaign import scheduler_campaign

    pins = ["--pin", "num_blocks=4", "--pin", "prefix_caching=true", "--pin", "model_runner=V2"]
    # seed 4: each of its four batches draws the full-attention model (a hybrid draw does not fail in the fake)
    argv = ["campaign", "--scheduler", "vllm-v1", "--seed", "4", "--max-examples", "100", "--no-known", *pins]
    fake = FakeTarget()
    emitted: list[Any] = []
    corpus = ["--corpus", str(tmp_path / "c")]
    status = scheduler_campaign(_parser().parse_args([*argv, *corpus, "--json"]), emitted.append, fake.target())
    [result] = emitted
    json.dumps(result)
    assert status == 1 and result["failures"], "the fake fails in every pinned batch (small pool, caching on)"
    assert fake.searches and all(
        setup.num_blocks == 4 and setup.prefix_caching and runner == "V2" for setup, runner, *_ in fake.searches
    )
    assert all(batch["num_blocks"] == 4 and batch["model_runner"] == "V2" for batch in result["batch_log"])
    expected = {"num_blocks": 4, "prefix_caching": True, "model_runner": "V2"}
    assert result["pins"] == expected and result["rerun"]["pins"] == expected
    rerun = shlex.split(result["rerun_command"])
    assert " ".join(pins) in " ".join(rerun)
    again = _parser().parse_args(rerun[1:])
    assert parse_pins(again.pin, TABLE) == tuple(expected.items())

    fake = FakeTarget()
    status = scheduler_campaign(_parser().parse_args([*argv, "--corpus", str(tmp_path / "d")]), print, fake.target())
    printed = capsys.readouterr().out
    assert "pinned: num_blocks=4, prefix_caching=true, model_runner=V2" in printed
    assert "--pin num_blocks=4 --pin prefix_caching=true --pin model_runner=V2" in printed


def test_pins_no_valid_configuration_goes_with_are_refused_before_any_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfuzz.cli import _parser
    from kvfuzz.commands.scheduler_campaign import scheduler_campaign

    fake = FakeTarget()  # refuses a token budget below the running-request cap, as vLLM does
    argv = ["campaign", "--scheduler", "vllm-v1", "--max-examples", "10", "--corpus", str(tmp_path / "c")]
    pins = ["--pin", "max_num_batched_tokens=1", "--pin", "max_num_seqs=2"]
    status = scheduler_campaign(_parser().parse_args([*argv, *pins]), print, fake.target())
    captured = capsys.readouterr()
    assert (status, captured.out, fake.searches) == (2, "", [])
    [line] = captured.err.splitlines()
    assert line.startswith("kvfuzz: --pin max_num_batched_tokens=1, max_num_seqs=2: no configuration with these pins")
    assert "1000 configurations drawn, every one refused (the last: " in line
    assert not (tmp_path / "c").exists()


def test_a_row_that_needs_another_is_set_only_where_that_row_drew_its_value() -> None:
    """Late transfers and failed loads mean something only with a KV connector: drawn without one, they would be
    refused (and redrawn) for nothing. Failed loads are drawn with the P/D connector (kvfuzz's worker side reports
    them), with the offloading connector only when pinned (vLLM's own worker never reports one)."""
    without = [swarm.draw(random.Random(seed), accept, pins={"kv_connector": "none"}).setup for seed in range(200)]
    pins = {"kv_connector": "offloading"}
    with_ = [swarm.draw(random.Random(seed), accept, pins=pins).setup for seed in range(200)]
    assert {s.kv_connector for s in without} == {"none"} and {s.kv_connector for s in with_} == {"offloading"}
    assert without and all(s.transfer_delay == 0 and not s.load_failures for s in without)
    assert {s.transfer_delay for s in with_} == {0, 1, 2, 3} and {s.load_failures for s in with_} == {False}
    pd = [swarm.draw(random.Random(seed), accept, pins={"kv_connector": "pd"}).setup for seed in range(200)]
    assert {s.transfer_delay for s in pd} == {0, 1, 2, 3} and {s.load_failures for s in pd} == {False, True}
    pins = {"load_failures": True, "kv_connector": "offloading"}
    failing = [swarm.draw(random.Random(seed), accept, pins=pins).setup for seed in range(20)]
    assert {(s.kv_connector, s.load_failures) for s in failing} == {("offloading", True)}


def test_an_unpinned_draw_runs_the_connector_about_a_fifth_of_the_time() -> None:
    """The offloading connector is drawn unpinned (its findings are classified: docs/scheduler-connectors.md), and
    the P/D connector about one time in eight, with async scheduling (deferred frees) in some of them."""
    drawn = [swarm.draw(random.Random(seed), accept).setup for seed in range(400)]
    connectors = [setup.kv_connector for setup in drawn]
    assert 50 <= connectors.count("offloading") <= 110 and set(connectors) == {"none", "offloading", "pd"}
    assert 30 <= connectors.count("pd") <= 80
    assert any(setup.kv_connector == "pd" and setup.async_scheduling for setup in drawn)
