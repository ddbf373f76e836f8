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


def test_a_run_s_swarm_draws_smaller_pools_the_factory_builds() -> None:
    from kvfuzz.engine import MachineConfig
    from kvfuzz.program.swarm import small_pools

    asked: list[tuple[int, int]] = []

    def builds(pool: MachineConfig) -> bool:  # a factory that builds no pool under 3 blocks
        asked.append((pool.block_size, pool.num_blocks))
        return pool.num_blocks >= 3

    pools = small_pools(MachineConfig(num_host_blocks=2), builds)
    geometries = {(pool.block_size, pool.num_blocks) for pool in pools}
    assert geometries == {(4, n) for n in (3, 4, 5, 6, 8, 12)} | {(2, n) for n in (3, 4, 5, 6, 8, 12, 16)}
    assert all(pool.num_host_blocks == 2 for pool in pools)  # the run's host pool, model and window stay
    assert asked == [(2, 2), (2, 3), (4, 2), (4, 3)]  # the smallest one it builds, then no more asking
    assert small_pools(MachineConfig(), lambda pool: False) == ()
    rng = random.Random(1)
    drawn = [draw_swarm(rng, pools=pools).config for _ in range(400)]
    assert 120 < sum(config is None for config in drawn) < 280  # half keep the run's own pool
    assert {config for config in drawn if config is not None} == set(pools)


def test_a_failure_met_in_a_drawn_pool_is_shrunk_confirmed_and_saved_in_it(tmp_path) -> None:
    """Before: the default run never met WholePoolPromptRefused (a prompt needing the whole pool is refused), which
    only a pool no larger than a prompt reaches; its swarm now draws one, and the trace records it."""
    from kvfuzz.commands.options import RUN_EXAMPLES
    from kvfuzz.engine import MachineConfig
    from kvfuzz.program.replay import replay
    from kvfuzz.runner import run
    from kvfuzz.saved.corpus import trace_of
    from kvfuzz.zoo import VARIANTS

    broken = next(variant for variant in VARIANTS if variant.name == "WholePoolPromptRefused")
    summary = run(broken.factory(), MachineConfig(), examples=RUN_EXAMPLES, seed=1)
    assert summary.violated is broken.expected, summary.explanation
    assert summary.pool is not None and summary.pool.num_blocks < 16
    assert summary.reproduced == summary.replays > 0
    assert "met in a pool the run's swarm drew" in (summary.describe_pool() or "")
    assert summary.to_json()["pool"]["num_blocks"] == summary.pool.num_blocks
    trace = trace_of(summary, "zoo:WholePoolPromptRefused", MachineConfig())
    assert trace is not None and trace.config == summary.pool
    replayed = replay(Target(broken.factory(), trace.config), list(trace.program))
    assert replayed.failure is not None
    assert replay(Target(broken.factory(), MachineConfig()), list(trace.program)).failure is None  # not in 16 blocks
