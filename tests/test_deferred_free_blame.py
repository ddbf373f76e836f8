"""Refcounts and the free, cached and pending sets are checked right after every ``step_completed``, so a fault in
deferred freeing is blamed on the step whose completion settled the blocks, not on whatever call comes next."""

from __future__ import annotations

import pytest

from kvfuzz.allocator import PagedAllocator, PoolSpec
from kvfuzz.engine import Engine
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.zoo import variant

CONFIG = MachineConfig(block_size=4, num_blocks=8, num_host_blocks=0)


def _engine(name: str) -> Engine:
    return Engine(variant(name).factory()(PoolSpec(4, 8)), CONFIG)


def _released_then_hit_inside_its_window(engine: Engine) -> None:
    """a's first block is cached, released by free, and matched by b before its window (W = 2) has closed."""
    engine.admit("a", (), (1, 2, 3, 4, 5))
    for _ in range(5):  # steps 0..4; step 2 completes, so a's full block is matchable
        engine.step()
    engine.free("a")
    assert engine.admit("b", (), (1, 2, 3, 4, 6))
    assert engine.expected.seqs["b"].written == 4  # b's hit covers a's released block


def test_a_stale_deferred_free_is_blamed_on_the_step_that_settles_the_block():
    engine = _engine("StaleDeferredFree")
    _released_then_hit_inside_its_window(engine)
    engine.step()  # completes step 3: nothing of a's is due yet
    with pytest.raises(InvariantViolation) as caught:
        engine.step()  # completes step 4: a's release comes due, and the variant settles the block b now holds
    violation = caught.value
    assert violation.invariant is Invariant.FREE_SET
    assert violation.operation == "step(), completing step 4", violation.explain()
    assert "referenced by [('b', 0)] yet listed as cached" in violation.summary


def test_the_correct_pool_passes_the_same_program():
    engine = Engine(PagedAllocator(4, 8, inflight_window=2), CONFIG)
    _released_then_hit_inside_its_window(engine)
    for _ in range(4):
        engine.step()
    engine.quiesce()


def test_a_dropped_deferred_free_is_blamed_on_the_step_that_drops_it():
    """DroppedDeferredFree settles one of two blocks due at one completion; before this check the next call took
    the blame."""
    engine = _engine("DroppedDeferredFree")
    engine.admit("a", (), (1, 2, 3, 4, 5))
    engine.step()
    engine.free("a")  # released while no step has completed: both blocks are due when step 1 completes
    engine.step()
    engine.step()  # completes step 0
    with pytest.raises(InvariantViolation) as caught:
        engine.step()  # completes step 1
    assert caught.value.invariant is Invariant.FREE_SET
    assert caught.value.operation == "step(), completing step 1", caught.value.explain()
