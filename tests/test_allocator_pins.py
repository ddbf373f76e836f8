"""``kvfuzz campaign --pin ROW=VALUE`` on allocators: the allocator's swarm table is rows of the one swarm-table
module (kvfuzz/swarm_table.py), as a scheduler's is, built from what the allocator builds; a pin is checked against
them (one line and exit status 2 before any work otherwise), every batch of a pinned campaign runs with the pinned
values, and the result and the rerun command record the pins. The scheduler's pins: tests/test_scheduler_pins.py."""

from __future__ import annotations

import json
import random
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from kvfuzz.campaign.swarm import Limits, allocator_rows, draw_swarm
from kvfuzz.engine.config import MachineConfig
from kvfuzz.program.operations import OPERATIONS
from kvfuzz.swarm_table import PinRefused, parse_pins

LIMITS = Limits("kvfuzz", (1, 2, 4, 8, 16), 1, 1, True, False, (0, 1, 2, 3))
"""What kvfuzz's own allocator builds (as probe_limits finds it: tests/test_campaign_swarm.py)."""


def test_each_allocator_row_draws_within_its_domain_and_reaches_its_ends() -> None:
    rng = random.Random(0)
    rows = allocator_rows(LIMITS)
    drawn: dict[str, set[Any]] = {row.name: set() for row in rows}
    for _ in range(4000):
        for row in rows:
            drawn[row.name].add(row.value(rng, {}))
    for row in rows:
        if row.name == "operations":
            names = [operation.name for operation in OPERATIONS]
            assert all(list(value) == [n for n in names if n in value] for value in drawn[row.name]), "table order"
            assert all({"admit", "step"} <= set(value) for value in drawn[row.name])
            assert tuple(names) in drawn[row.name], "one draw in four keeps every operation"
        else:
            assert drawn[row.name] <= set(row.domain), row.name
            assert min(row.domain) in drawn[row.name] and max(row.domain) in drawn[row.name], row.name


def test_a_pool_without_host_blocks_draws_none_and_a_host_cache_always_some() -> None:
    rng = random.Random(1)
    without = Limits("x", (4,), 2, 0, False)
    cached = Limits("y", (4,), 2, 0, True, True)
    assert {draw_swarm(rng, without, MachineConfig()).machine.num_host_blocks for _ in range(200)} == {0}
    assert min(draw_swarm(rng, cached, MachineConfig()).machine.num_host_blocks for _ in range(200)) >= 1
    assert [row.name for row in allocator_rows(without)][-1] == "operations", "no W row: the factory keeps its own"


def test_a_pinned_draw_holds_its_rows_and_draws_the_others_as_unpinned() -> None:
    pins = dict(parse_pins(["block_size=2", "operations=rollback,SWAP_OUT", "window=2"], allocator_rows(LIMITS)))
    assert pins["operations"] == ("admit", "step", "swap_out", "rollback"), "the table's order, with admit and step"
    for seed in range(100):
        pinned = draw_swarm(random.Random(seed), LIMITS, MachineConfig(), pins)
        free = draw_swarm(random.Random(seed), LIMITS, MachineConfig())
        assert (pinned.machine.block_size, pinned.machine.inflight_window) == (2, 2)
        assert pinned.operations == pins["operations"]
        assert (pinned.machine.num_blocks, pinned.machine.num_host_blocks, pinned.program_length) == (
            free.machine.num_blocks,
            free.machine.num_host_blocks,
            free.program_length,
        )


@pytest.mark.parametrize(
    "texts, line",
    [
        (["block_size=3"], "--pin block_size=3: block_size takes one of 1, 2, 4, 8, 16"),
        (["num_blocks=0"], "--pin num_blocks=0: num_blocks takes 1..256"),
        (["host_blocks=33"], "--pin host_blocks=33: host_blocks takes 0..32"),
        (["operations=swap,teleport"], "--pin operations=swap,teleport: operations takes names of admit, "),
        (["model=full"], "--pin model=full: no swarm row 'model'; the rows: num_blocks, block_size, host_blocks, "),
    ],
)
def test_a_bad_allocator_pin_is_refused_in_one_line(texts: list[str], line: str) -> None:
    with pytest.raises(PinRefused) as refused:
        parse_pins(texts, allocator_rows(LIMITS))
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value), str(refused.value)


def test_the_cli_refuses_a_bad_pin_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfuzz.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["campaign", "--max-examples", "5", "--workers", "1", "--pin", "block_size=3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == ["kvfuzz: --pin block_size=3: block_size takes one of 1, 2, 4, 8, 16"]
    assert not list(tmp_path.iterdir()), "a refused campaign leaves nothing behind"


def test_pins_whose_pool_the_allocator_never_builds_are_refused_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A factory may refuse pool sizes between those the probe asked for: pinned to one, a campaign would draw
    forever. It is refused first."""
    (tmp_path / "odd_pools.py").write_text(
        "from kvfuzz.allocator.paged import paged_allocator\n"
        "def factory(spec):\n"
        "    if spec.num_blocks == 5:\n"
        "        raise ValueError('five blocks do not fill a sector')\n"
        "    return paged_allocator(spec)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    from kvfuzz.cli import main

    argv = ["campaign", "--allocator", "odd_pools:factory", "--max-examples", "5", "--workers", "1"]
    try:
        assert main([*argv, "--pin", "num_blocks=5"]) == 2
    finally:
        sys.modules.pop("odd_pools", None)  # pytester's runs in this process would find it
    assert capsys.readouterr().err.splitlines() == [
        "kvfuzz: --pin num_blocks=5: odd_pools:factory builds the pool of no configuration with these pins"
    ]
    assert not (tmp_path / "corpus").exists() and not (tmp_path / "kvfuzz-corpus").exists()


def test_a_pinned_campaign_saves_its_finding_under_the_pins_and_records_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfuzz.cli import _parser, main

    monkeypatch.chdir(tmp_path)
    pins = ["--pin", "block_size=2", "--pin", "num_blocks=6", "--pin", "operations=fork,grow"]
    argv = ["campaign", "--allocator", "zoo:NoCopyOnWrite", "--stop-after", "1", "--workers", "1", "--seed", "3"]
    status = main([*argv, "--max-examples", "400", "--no-known", "--corpus", "found", *pins, "--json"])
    result = json.loads(capsys.readouterr().out)
    assert status == 1 and [failure["new"] for failure in result["failures"]] == [True], result
    expected = {"block_size": 2, "num_blocks": 6, "operations": ["admit", "step", "grow", "fork"]}
    assert result["pins"] == expected and result["rerun"]["pins"] == expected
    [trace] = [json.loads(path.read_text()) for path in (tmp_path / "found").glob("*.json")]
    # drawn with 6 blocks; shrinking may make the pool smaller still (the smallest that fails is the report's)
    assert trace["config"]["block_size"] == 2 and trace["config"]["num_blocks"] <= 6
    assert trace["swarm"]["operations"] == ["admit", "step", "grow", "fork"]
    assert {call["rule"] for call in trace["program"]} <= {"admit", "step", "grow", "fork"}, trace["program"]
    rerun = shlex.split(result["rerun_command"])
    assert "--pin block_size=2 --pin num_blocks=6 --pin operations=admit,step,grow,fork" in shlex.join(rerun)
    assert _parser().parse_args(rerun[1:]).pin == [
        "block_size=2",
        "num_blocks=6",
        "operations=admit,step,grow,fork",
    ]


def test_pinned_operations_hold_in_every_batch_hypothesis_rounds_included(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: one batch in four was a Hypothesis round over the whole operation table, so a campaign pinned to
    grow alone found NoCopyOnWrite's bug through fork (and saved a trace whose swarm said grow). A campaign that pins
    the operations or the program length now runs random batches alone."""
    from kvfuzz.cli import main

    monkeypatch.chdir(tmp_path)
    argv = ["campaign", "--allocator", "zoo:NoCopyOnWrite", "--pin", "operations=grow", "--max-examples", "200"]
    status = main(
        [*argv, "--workers", "1", "--seed", "1", "--stop-after", "1", "--no-known", "--corpus", "c", "--json"]
    )
    result = json.loads(capsys.readouterr().out)
    assert (status, result["failures"]) == (0, []), "no fork without fork"
    assert result["examples"] == 200


def test_a_refusal_names_the_allocator_only_where_the_tables_differ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: with two allocators of one table, an unknown row read "no swarm row 'nothing' for kvfuzz", as if
    the other had it."""
    from kvfuzz.cli import main

    monkeypatch.chdir(tmp_path)
    same = ["campaign", "--allocator", "kvfuzz", "--allocator", "zoo:NoCopyOnWrite", "--max-examples", "5"]
    assert main([*same, "--pin", "nothing=3"]) == 2
    assert capsys.readouterr().err.startswith("kvfuzz: --pin nothing=3: no swarm row 'nothing'; the rows: ")
    synchronous = "kvfuzz.allocator.paged:synchronous_allocator"  # it keeps its own W: no window row
    assert main(["campaign", "--allocator", "kvfuzz", "--allocator", synchronous, "--pin", "window=2"]) == 2
    assert capsys.readouterr().err.startswith(f"kvfuzz: --pin window=2: no swarm row 'window' for {synchronous}; ")
    assert not list(tmp_path.iterdir())
