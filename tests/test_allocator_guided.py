"""``kvfuzz campaign --guided`` on allocators: the coverage feedback every target shares (kvfuzz/campaign/feedback.py)
keeps each random program that reached new code of the allocator as a seed, and half the batches then run mutants of
one (kvfuzz/program/mutants.py). A mutant is a program like any: it makes only calls a replay accepts, so a correct
allocator never fails one, and a failure it meets is claimed, shrunk and saved."""

from __future__ import annotations

import json
import multiprocessing
import queue
import random
import threading
from pathlib import Path
from typing import Any, Optional

import attrs
import pytest

from kvfuzz.campaign.known import KnownFindings
from kvfuzz.campaign.messages import Batch, Saved
from kvfuzz.campaign.protocol import Reporter, WorkerContext
from kvfuzz.campaign.seeds import SEED_DIRECTORY, Seed, SeedPool
from kvfuzz.campaign.swarm import SwarmConfig, draw_swarm, probe_limits, swarm_of, swarm_values
from kvfuzz.campaign.worker import SEEDS, WorkerPlan, _Worker
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.program.call import Call, program_json
from kvfuzz.program.execution import Safeguards, Target
from kvfuzz.program.mutants import Fresh, Gene, mutate, run_mutant
from kvfuzz.program.operations import OPERATIONS
from kvfuzz.program.random_programs import CallDraws, random_search
from kvfuzz.program.replay import replay
from kvfuzz.program.safeguards import Journal
from kvfuzz.program.swarm import draw_operations
from kvfuzz.registry import load_factory
from kvfuzz.saved.trace import program_from_json


def _program(target: Target, rng: random.Random, length: int, operations: Any = OPERATIONS) -> list[Call]:
    """A random program that ran to its end on ``target`` (kvfuzz's own allocator: it never fails)."""
    execution = target.start()
    draws = CallDraws(execution, operations)
    for _ in range(length):
        drawn = draws.draw(rng)
        if drawn is None:
            break
        execution.execute(*drawn)
    execution.teardown()
    return list(execution.calls)


def _made(target: Target, rng: random.Random, genes: tuple[Gene, ...], tmp_path: Path, operations: Any) -> list[Call]:
    """The calls ``run_mutant`` made, as its journal lists them (the worker's seeds are these records)."""
    journal = Journal(tmp_path, {"allocator": "kvfuzz"}, {})
    found = run_mutant(attrs.evolve(target, safeguards=Safeguards(journal)), rng, genes, operations)
    assert found is None, f"a mutant failed on kvfuzz's own allocator: {found.failure}"
    lines = [json.loads(line) for line in journal.path.read_text().splitlines()]
    journal.close()
    return program_from_json(lines[[index for index, line in enumerate(lines) if "example" in line][-1] + 1 :])


def test_a_mutant_makes_only_calls_a_replay_accepts_and_a_correct_allocator_passes_it(tmp_path: Path) -> None:
    """Mutations strand calls (a grow of a sequence whose admission was deleted, an admission of an id a fresh call
    took); the mutant skips what the state cannot take, so what it made replays call for call."""
    rng = random.Random(20261206)
    factory = load_factory("kvfuzz")
    for trial in range(25):
        config = attrs.evolve(
            MachineConfig(),
            num_blocks=rng.choice((2, 4, 12, 40)),
            block_size=rng.choice((1, 2, 4)),
            num_host_blocks=rng.choice((0, 4)),
            inflight_window=rng.choice((None, 0, 2)),
        )
        operations = draw_operations(rng, list(OPERATIONS))
        target = Target(factory, config)
        seed, other = (_program(target, rng, rng.randint(3, 60), operations) for _ in range(2))
        for _ in range(3):
            made = _made(target, rng, mutate(seed, rng, other), tmp_path / str(trial), operations)
            outcome = replay(target, made)  # NotApplicable if the mutant made a call the state could not take
            assert outcome.failure is None, outcome.failure


def test_a_mutant_skips_the_calls_a_deletion_stranded_as_a_replay_does(tmp_path: Path) -> None:
    rng = random.Random(3)
    target = Target(load_factory("kvfuzz"), MachineConfig())
    seed = _program(target, rng, 40)
    assert seed[0].rule == "admit" and any(str(seed[0].kwargs()["seq"]) in str(call) for call in seed[1:])
    made = _made(target, rng, tuple(seed[1:]), tmp_path, OPERATIONS)
    kept: list[Call] = []
    replay(target, seed[1:], on_call=lambda index, call: kept.append(call), skip_stranded=True)
    assert made == kept and len(kept) < len(seed) - 1, "the stranded calls skipped, the others kept in order"
    assert _made(target, rng, tuple(seed), tmp_path / "whole", OPERATIONS) == seed, "an unmutated seed runs as is"


def test_a_fresh_call_draws_its_operation_where_it_is_enabled_else_any(tmp_path: Path) -> None:
    rng = random.Random(4)
    target = Target(load_factory("kvfuzz"), MachineConfig())
    made = _made(target, rng, (Fresh("admit"), Fresh("grow"), Fresh(None)), tmp_path, OPERATIONS)
    assert [call.rule for call in made[:2]] == ["admit", "grow"] and len(made) == 3
    first = _made(target, rng, (Fresh("grow"),), tmp_path / "first", OPERATIONS)
    assert [call.rule for call in first] == ["admit"], "nothing to grow yet: an enabled operation instead"


def test_mutation_never_empties_a_program_and_caps_its_length() -> None:
    rng = random.Random(8)
    call = Call("admit", {"seq": "s0", "tags": (), "lengths": (1,)})
    for _ in range(200):
        assert 1 <= len(mutate([call], rng)) <= 1000
    assert mutate([], rng) != ()


def test_mutants_of_a_program_one_call_short_of_a_seeded_bug_meet_it() -> None:
    """A random program meets NoCopyOnWrite's bug in its last call; its mutants without that call meet it again
    (inserted calls, redrawn arguments), where the seed alone does not."""
    target = Target(load_factory("zoo:NoCopyOnWrite"), MachineConfig())
    found = random_search(target, examples=200, steps=40, seed=1)
    assert found is not None and _exclusive_writes(found.failure)
    seed = list(found.calls[:-1])
    assert replay(target, seed).failure is None
    rng = random.Random(0)
    met = [run_mutant(target, rng, mutate(seed, rng), OPERATIONS) for _ in range(100)]
    assert any(failure is not None and _exclusive_writes(failure.failure) for failure in met)


def _exclusive_writes(failure: BaseException) -> bool:
    return isinstance(failure, InvariantViolation) and failure.invariant is Invariant.EXCLUSIVE_WRITES


# -- a seed's configuration --------------------------------------------------------------------------------------


def test_a_seed_s_configuration_reads_back_as_the_swarm_it_was_and_a_foreign_one_is_refused() -> None:
    base = MachineConfig()
    limits = probe_limits("kvfuzz", load_factory("kvfuzz"), base)
    rng = random.Random(2)
    for _ in range(30):
        swarm = draw_swarm(rng, limits, base)
        values = json.loads(json.dumps(swarm_values(swarm)))  # as a seed file holds it
        assert swarm_of(values, limits, base) == swarm
    values = json.loads(json.dumps(swarm_values(draw_swarm(rng, limits, base))))
    refused = [
        {**values, "allocator": "zoo:NoCopyOnWrite"},
        {**values, "block_size": 3},
        {**values, "num_blocks": "4"},
        {**values, "operations": ["grow"]},  # admit is always kept
        {**values, "operations": ["admit", "teleport"]},
        {**values, "colour": 1},
        {key: value for key, value in values.items() if key != "program_length"},
    ]
    for foreign in refused:
        with pytest.raises(ValueError):
            swarm_of(foreign, limits, base)


# -- the worker ----------------------------------------------------------------------------------------------------


def _worker(tmp_path: Path, spec: str, examples: int, pins: Any = ()) -> tuple[_Worker, queue.Queue[Any]]:
    base = MachineConfig()
    plan = WorkerPlan(
        slot=0,
        seed=11,
        allocators=(spec,),
        limits=(probe_limits(spec, load_factory(spec), base),),
        base=base,
        corpus=tmp_path / "corpus",
        database=str(tmp_path / "examples"),
        state=tmp_path / "state",
        call_timeout=None,
        shrink_seconds=2.0,
        hypothesis_every=0,
        pins=pins,
        coverage=True,
        guided=True,
    )
    messages: queue.Queue[Any] = queue.Queue()
    budget = multiprocessing.get_context("spawn").Value("q", examples)
    stop: Any = threading.Event()  # the stop and halt flags, as threading's events
    halt: Any = threading.Event()
    context = WorkerContext(
        0,
        0,
        11,
        Reporter(messages, 0),
        stop,
        halt,
        budget,
        KnownFindings(),
        plan.state,
        plan.state / "c",
    )
    return _Worker(plan, context), messages


def _plant(tmp_path: Path, swarm: SwarmConfig, calls: list[Call], target: str = SEEDS) -> Seed:
    """A seed in the campaign's pool that reached more new points than any the worker keeps (drawn most often)."""
    seed = Seed.of(target, swarm_values(swarm), program_json(tuple(calls)), 100_000)
    SeedPool(tmp_path / "state" / SEED_DIRECTORY, target).add(seed)
    return seed


def test_a_guided_worker_mutates_a_seed_and_a_mutant_s_failure_is_shrunk_and_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seed one call short of NoCopyOnWrite's bug, planted in the campaign's pool: the worker's mutant batches meet
    the bug, and the failure goes the way of any (claimed, shrunk, saved as a trace that replays to it)."""
    spec = "zoo:NoCopyOnWrite"
    config = MachineConfig(inflight_window=1)  # a W of the swarm table (this factory builds the W asked for)
    found = random_search(Target(load_factory(spec), config), examples=200, steps=40, seed=1)
    assert found is not None
    swarm = SwarmConfig(spec, config, 40, tuple(operation.name for operation in OPERATIONS))
    planted = _plant(tmp_path, swarm, list(found.calls[:-1]))
    worker, messages = _worker(tmp_path, spec, examples=200)
    in_mutants: list[str] = []
    mutant_batch, failure = _Worker.mutant_batch, _Worker.failure

    def watched_batch(self: _Worker, mutants: Any) -> None:
        in_mutants.append(mutants.digest)
        mutant_batch(self, mutants)
        in_mutants.pop()

    def watched_failure(self: _Worker, *args: Any) -> None:
        if in_mutants:
            met.append(in_mutants[-1])
        failure(self, *args)

    met: list[str] = []
    monkeypatch.setattr(_Worker, "mutant_batch", watched_batch)
    monkeypatch.setattr(_Worker, "failure", watched_failure)
    worker.search()
    assert planted.digest in met, "a mutant of the planted seed met a failure"
    drained = _drain(messages)
    saved = [message for message in drained if isinstance(message, Saved)]
    assert saved and all(message.trace is not None for message in saved)
    log = [message.entry for message in drained if isinstance(message, Batch)]
    assert {entry["batch"] for entry in log} == {"random", "mutants"}, "no Hypothesis rounds in this worker"
    mutated = [entry for entry in log if entry["batch"] == "mutants"]
    assert all(entry["mutated_seed"] and entry["examples"] > 0 and entry["seeds"] > 0 for entry in mutated)
    assert sum(entry["examples"] for entry in log) == 200, "every example of the budget, in the log"
    kept = list((tmp_path / "state" / SEED_DIRECTORY).glob(f"{SEEDS}-*.json"))
    assert len(kept) > 1, "the worker's own random programs that reached new code are kept too"
    for path in kept:
        data = json.loads(path.read_text())
        assert swarm_of(data["config"], worker.limits[spec], MachineConfig()).allocator == spec
        program_from_json(data["program"])


def test_a_seed_outside_the_campaign_s_allocators_or_pins_is_never_mutated(tmp_path: Path) -> None:
    base = MachineConfig()
    other_limits = probe_limits("kvfuzz-synchronous", load_factory("kvfuzz-synchronous"), base)
    program = _program(Target(load_factory("kvfuzz"), base), random.Random(1), 10)
    _plant(tmp_path, draw_swarm(random.Random(1), other_limits, base), program)
    limits = probe_limits("kvfuzz", load_factory("kvfuzz"), base)
    unpinned = draw_swarm(random.Random(2), limits, base, {"block_size": 4})
    _plant(tmp_path, unpinned, program)
    worker, _ = _worker(tmp_path, "kvfuzz", examples=0, pins=(("block_size", 1),))
    assert worker.feedback is not None and worker.feedback.pool is not None
    assert worker.feedback.pool.refresh() == 2
    assert worker.mutants() is None and not worker.feedback.pool.seeds, "both dropped, neither mutated"
    pinned = _plant(tmp_path, attrs.evolve(unpinned, machine=attrs.evolve(unpinned.machine, block_size=1)), program)
    worker.feedback.pool.refresh()
    chosen: Optional[Any] = worker.mutants()
    assert chosen is not None and chosen.digest == pinned.digest and list(chosen.program) == program


def _drain(messages: queue.Queue[Any]) -> list[Any]:
    drained = []
    while not messages.empty():
        drained.append(messages.get())
    return drained


def test_the_batch_log_lists_the_last_batches_and_counts_them_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An allocator worker runs a few batches a second: the result lists the last BATCH_LOG_LIMIT of them (an
    hours-long campaign on many workers would otherwise hold millions), and ``batches`` counts them all."""
    from kvfuzz.campaign import supervisor
    from kvfuzz.cli import main

    monkeypatch.chdir(tmp_path)
    argv = ["campaign", "--workers", "1", "--max-examples", "150", "--seed", "5", "--no-known", "--json"]
    assert main([*argv, "--corpus", "whole"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert whole["batches"] == len(whole["batch_log"]) > 3
    assert sum(entry["examples"] for entry in whole["batch_log"]) == whole["examples"] == 150
    monkeypatch.setattr(supervisor, "BATCH_LOG_LIMIT", 3)
    assert main([*argv, "--corpus", "cut"]) == 0
    cut = json.loads(capsys.readouterr().out)
    assert cut["batches"] == whole["batches"] and len(cut["batch_log"]) == 3
    # the same seed draws the same batches (a Hypothesis round's calls are Hypothesis's own: not compared)
    assert [_drawn(entry) for entry in cut["batch_log"]] == [_drawn(entry) for entry in whole["batch_log"][-3:]]


def _drawn(entry: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in entry.items() if key != "steps"}
