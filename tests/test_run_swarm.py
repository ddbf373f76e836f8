"""kvfuzz run's swarmed random programs: every third program is drawn over a weighted subset of the operation table,
and the others stay exactly the whole table's programs a run without the swarm makes."""

from __future__ import annotations

import random
from typing import Any

from kvfuzz.allocator import paged_allocator
from kvfuzz.program import random_programs
from kvfuzz.program.execution import Target
from kvfuzz.program.operations import BY_NAME
from kvfuzz.program.stats import RunStats
from kvfuzz.program.swarm import ALWAYS_ENABLED, FACTORS, WEIGHTS, draw_swarm


def _programs_started(monkeypatch, swarm) -> list[tuple[Any, int, int, bool]]:
    """Every program random_search starts: its generator's state, length, operations and whether it is weighted."""
    started: list[tuple[Any, int, int, bool]] = []
    real = random_programs.random_program

    def recording(target, rng, length, operations=random_programs.OPERATIONS, weights=None):
        started.append((rng.getstate(), length, len(operations), weights is not None))
        return real(target, rng, length, operations, weights)

    monkeypatch.setattr(random_programs, "random_program", recording)
    assert random_programs.random_search(Target(paged_allocator), examples=9, steps=20, seed=3, swarm=swarm) is None
    return started


def test_the_whole_tables_programs_are_the_ones_a_run_without_the_swarm_makes(monkeypatch) -> None:
    plain = _programs_started(monkeypatch, None)
    swarmed = _programs_started(monkeypatch, draw_swarm)
    assert [weighted for *_, weighted in swarmed] == [False, False, True] * 3
    whole_table = [program for program in swarmed if not program[3]]
    assert whole_table == plain[: len(whole_table)]  # same generator state and length: the same program
    assert all(length >= 10 for _, length, _, weighted in swarmed if weighted)  # at least half the step budget


def test_a_swarm_keeps_admit_and_step_and_weighs_what_it_keeps() -> None:
    rng = random.Random(0)
    for _ in range(50):
        swarm = draw_swarm(rng)
        assert set(ALWAYS_ENABLED) <= set(swarm.names())
        assert len(swarm.weights) == len(swarm.operations) and all(weight > 0 for weight in swarm.weights)
        assert all(weight / WEIGHTS.get(name, 1.0) in FACTORS for name, weight in zip(swarm.names(), swarm.weights))


def test_a_weighted_program_calls_its_operations_in_proportion_to_their_weights() -> None:
    stats = RunStats()
    operations = [BY_NAME["admit"], BY_NAME["step"]]
    found = random_programs.random_program(
        Target(paged_allocator, stats=stats), random.Random(0), 200, operations, weights=[1.0, 30.0]
    )
    assert found is None
    assert stats.operations["step"] > 10 * stats.operations["admit"] > 0, stats.operations
