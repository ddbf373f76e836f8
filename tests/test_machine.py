"""The machine runs clean against kvfuzz's correct allocator in every configuration it supports."""

from __future__ import annotations

import pytest
import torch
from factories import make_allocator
from hypothesis.stateful import run_state_machine_as_test

from kvfuzz.allocator import PagedAllocator, paged_allocator
from kvfuzz.profiles import PROFILES
from kvfuzz.reference import ModelShape
from kvfuzz.runner import run
from kvfuzz.statemachines import MachineConfig, machine_for

CI = PROFILES["ci"]


@pytest.mark.parametrize(
    "factory",
    [
        make_allocator(window=0),
        pytest.param(make_allocator(window=1), marks=pytest.mark.slow),
        pytest.param(make_allocator(window=2), marks=pytest.mark.slow),
        pytest.param(make_allocator(window=1, prefix_caching=False), marks=pytest.mark.slow),
        pytest.param(make_allocator(window=1, introspection=False), marks=pytest.mark.slow),
        pytest.param(make_allocator(window=0, reserved_blocks=2), marks=pytest.mark.slow),
    ],
    ids=lambda factory: factory.__name__,
)
def test_correct_allocator_passes_under_ci_profile(factory) -> None:
    run_state_machine_as_test(machine_for(factory, MachineConfig()), settings=CI)


@pytest.mark.parametrize(
    ("sliding_window", "window"),
    [
        (4, 0),
        pytest.param(4, 2, marks=pytest.mark.slow),
        pytest.param(9, 0, marks=pytest.mark.slow),
        pytest.param(9, 2, marks=pytest.mark.slow),
    ],
)
def test_correct_sliding_window_allocator_passes(window, sliding_window) -> None:
    def factory(spec):
        return PagedAllocator(spec.block_size, spec.num_blocks, inflight_window=window, sliding_window=sliding_window)

    run_state_machine_as_test(machine_for(factory, MachineConfig()), settings=CI)


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_correct_allocator_passes_in_half_precision(dtype) -> None:
    config = MachineConfig(shape=ModelShape(num_layers=3, num_kv_heads=1, num_query_heads=3, dtype=dtype))
    run_state_machine_as_test(machine_for(paged_allocator, config), settings=CI)


def test_a_run_exercises_every_operation() -> None:
    """The operation mix reaches every rule, refusals, copy-on-write, cache hits, evictions, swaps and misuse."""
    summary = run(paged_allocator, MachineConfig(), examples=150, steps=50)
    assert not summary.failed, summary.explanation
    for operation in (
        "admit",
        "readmit",
        "grow",
        "fork",
        "free",
        "preempt",
        "swap_out",
        "swap_in",
        "rollback",
        "evict",
        "reset_cache",
        "step",
        "misuse",
        "refused (out of blocks)",
        "copy-on-write copies",
        "cache hits",
        "evicted blocks",
    ):
        assert summary.operations.get(operation, 0) > 0, f"{operation} never exercised: {summary.operations}"
    assert summary.steps >= 150 * 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_correct_allocator_passes_on_cuda() -> None:
    config = MachineConfig(shape=ModelShape(device="cuda"))
    run_state_machine_as_test(machine_for(paged_allocator, config), settings=CI)


@pytest.mark.slow
@pytest.mark.parametrize("window", [0, 1, 3])
def test_long_campaign(window) -> None:
    """A thousand long random examples per in-flight window (about 1.5 CPU-minutes each): CI's slow step runs them."""
    summary = run(make_allocator(window=window), MachineConfig(), examples=1000, steps=100, seed=window)
    assert not summary.failed, f"{summary.program}\n{summary.explanation}"


def test_random_programs_pass_on_the_correct_allocator_and_replay_on_a_broken_one() -> None:
    from kvfuzz.program.execution import Target
    from kvfuzz.program.random_programs import random_search
    from kvfuzz.program.replay import replay
    from kvfuzz.zoo import variant

    assert random_search(Target(paged_allocator), examples=100, steps=50, seed=0) is None
    broken = Target(variant("NoCopyOnWrite").factory())
    found = random_search(broken, examples=300, steps=50, seed=0)
    assert found is not None and found.calls
    assert type(replay(broken, found.calls).failure) is type(found.failure)
