"""The host pool is checked like the device pool: its free set after every call that touches it (invariant 4), and
at quiescence (invariant 10), so a host-block leak is caught at the call that leaked."""

from __future__ import annotations

import pytest

from kvfuzz.allocator import HostIntrospectable, PagedAllocator
from kvfuzz.engine import Engine
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.runner import run
from kvfuzz.zoo import variant

CONFIG = MachineConfig(block_size=4, num_blocks=8, num_host_blocks=4)


def _swapped_out(allocator: PagedAllocator) -> Engine:
    engine = Engine(allocator, CONFIG)
    engine.admit("a", (), (1, 2, 3, 4, 5))
    engine.step()
    assert engine.swap_out("a")
    return engine


def test_kvfuzz_allocator_exposes_its_host_free_set():
    allocator = PagedAllocator(4, 8, 4)
    assert isinstance(allocator, HostIntrospectable)
    assert sorted(allocator.host_free_blocks()) == [0, 1, 2, 3]


def test_a_host_leak_on_freeing_a_swapped_out_sequence_is_blamed_on_that_free():
    engine = _swapped_out(variant("HostLeakOnFreeSwapped").factory()(CONFIG.pool_spec()))
    with pytest.raises(InvariantViolation) as caught:
        engine.free("a")
    violation = caught.value
    assert violation.invariant is Invariant.FREE_SET
    assert violation.operation == "free('a')"
    assert "is held by no swapped-out sequence, yet is not in the host free set" in violation.summary
    assert "free('a') of a swapped-out sequence leaked it" in violation.summary


def test_the_correct_allocator_frees_and_swaps_back_cleanly():
    engine = _swapped_out(PagedAllocator(4, 8, 4, inflight_window=1))
    assert engine.swap_in("a")
    assert engine.swap_out("a")
    engine.free("a")
    engine.quiesce()


class _SwapInKeepsHostBlocks(PagedAllocator):
    """Swap-in copies the K/V back but forgets to return the host blocks."""

    def swap_in(self, seq):
        host = list(self._seqs[seq].host_table or ())
        result = super().swap_in(seq)
        for block in host:
            del self._host_free[block]
        return result


def test_a_host_leak_on_swap_in_is_blamed_on_the_swap_in():
    engine = _swapped_out(_SwapInKeepsHostBlocks(4, 8, 4))
    with pytest.raises(InvariantViolation) as caught:
        engine.swap_in("a")
    assert caught.value.invariant is Invariant.FREE_SET and caught.value.operation == "swap_in('a')"


class _SwapOutLeavesHostBlocksFree(PagedAllocator):
    """Swap-out hands out host blocks but leaves them listed free, so a second swap-out could double-book them."""

    def swap_out(self, seq):
        result = super().swap_out(seq)
        for _, host in result.mapping:
            self._host_free[host] = None
        return result


def test_a_host_block_held_yet_listed_free_is_caught_at_the_swap_out():
    with pytest.raises(InvariantViolation) as caught:
        _swapped_out(_SwapOutLeavesHostBlocksFree(4, 8, 4))
    assert caught.value.invariant is Invariant.FREE_SET and caught.value.operation == "swap_out('a')"
    assert "yet is listed in the host free set" in caught.value.summary


class _LeaksHostBlockQuietly(PagedAllocator):
    """Keeps one host block out of the free set from the start: only the quiescence check can see it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        del self._host_free[3]


def test_quiescence_checks_every_host_block_is_free():
    engine = Engine(_LeaksHostBlockQuietly(4, 8, 4), CONFIG)
    with pytest.raises(InvariantViolation) as caught:
        engine.quiesce()
    assert caught.value.invariant is Invariant.QUIESCENCE
    assert "leaked:   [3]" in caught.value.explain()


def test_the_leak_is_found_by_a_run_and_named_at_its_cause():
    summary = run(variant("HostLeakOnFreeSwapped").factory(), MachineConfig(), examples=300, steps=50)
    assert summary.failed and summary.violated is Invariant.FREE_SET, summary.explanation
    assert "of a swapped-out sequence leaked it" in summary.explanation


class _HostRefusalKeepsWhatItTook(PagedAllocator):
    """Swap-out takes the free host blocks one by one and, finding too few, refuses without handing them back."""

    def swap_out(self, seq):
        state = self._running(seq, "swap_out")
        if len(state.table) > len(self._host_free):
            self._host_free.clear()
        return super().swap_out(seq)


def test_a_refusal_that_keeps_host_blocks_is_not_atomic():
    engine = Engine(_HostRefusalKeepsWhatItTook(4, 8, 4), CONFIG)
    engine.admit("a", (), (1, 2, 3, 4, 5))
    engine.admit("b", (), (1, 2, 3, 0, 1, 2, 3, 0, 1))
    engine.step()
    assert engine.swap_out("a")  # two of the four host blocks
    with pytest.raises(InvariantViolation) as caught:
        engine.swap_out("b")  # needs three: refused, but the other two host blocks are gone
    assert caught.value.invariant is Invariant.ATOMIC_REFUSAL
    assert "host_free=2" in caught.value.explain() and "host_free=0" in caught.value.explain()
