"""``dedupes_copied_tail``: a grow that copies a shared partial tail on write and fills it may map, instead of the
copy's destination, a block already holding the same K/V, and drop the destination with the copy still ordered
(vLLM v0 deduplicates the full block by content). The copy is then wasted work into a block nobody holds; a copy
into a block someone references, or a table mapping other content, stays a violation."""

from __future__ import annotations

from typing import Any, Optional

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from kvfuzz.allocator import BlockCopy, GrowResult, PoolSpec, Slot
from kvfuzz.allocator.paged import PagedAllocator, _Registration, _Sequence
from kvfuzz.allocator.prefix_cache import CacheEntry
from kvfuzz.allocator.types import SeqId, Tokens
from kvfuzz.engine import Engine, Invariant, InvariantViolation
from kvfuzz.statemachines import MachineConfig, machine_for

CONFIG = MachineConfig(block_size=8, num_blocks=16, num_host_blocks=0)
PROMPT = tuple(range(23))  # two full blocks and a tail of seven tokens


class _DedupesCopiedTail(PagedAllocator):
    """kvfuzz's allocator (W = 0) that, like vLLM v0, looks a tail block up by content once a copy-on-write grow
    fills it: if another running sequence maps a block with the same namespace and tokens at that index, the table
    takes that block and the copy's fresh destination goes back to the free pool, the copy still ordered. Both
    sequences then write the same slot with identical K/V, which ``recomputes_in_place`` (declared as vLLM v0 does)
    allows. Seeded bugs: ``by_index`` takes any full block at that index (other K/V), ``leaks_destination`` never
    frees the destination, and ``copies_into`` names another sequence whose first block the copy goes into."""

    def __init__(
        self,
        spec: PoolSpec,
        *,
        declare: bool = True,
        by_index: bool = False,
        leaks_destination: bool = False,
        copies_into: Optional[SeqId] = None,
    ) -> None:
        super().__init__(spec.block_size, spec.num_blocks, spec.num_host_blocks)
        # as vLLM v0 declares: its content lookup may find a block whose writes the next step makes
        self.capabilities = attrs.evolve(
            self.capabilities, dedupes_copied_tail=declare, recomputes_in_place=True, hits_scheduled_writes=True
        )
        self._by_index = by_index  # the seeded bug: a block of other content taken
        self._leaks_destination = leaks_destination  # the seeded bug: the dropped destination never freed
        self._copies_into = copies_into  # the seeded bug: the copy reported into this sequence's first block

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        state = self._running(seq, "grow")
        old_len = len(state.tokens)
        index = old_len // self.block_size
        result = super().grow(seq, tokens)
        if not result.copies or len(state.tokens) < (index + 1) * self.block_size:
            return result
        twin = self._twin(seq, state, index)
        if twin is None:
            return result
        destination = state.table[index]
        self._pool.take(twin)
        if not self._leaks_destination:
            self._pool.release(destination)
        state.table[index] = twin
        self._register_twin(state, index, twin)
        copies = result.copies
        if self._copies_into is not None:
            copies = tuple(BlockCopy(copy.src, self._seqs[self._copies_into].table[0]) for copy in copies)
        size = self.block_size
        slots = [Slot(state.table[position // size], position % size) for position in range(old_len, len(state.tokens))]
        return GrowResult(slots, copies)

    def _register_twin(self, state: _Sequence, index: int, twin: int) -> None:
        """The registration the grow scheduled for the dropped destination, for the block the table maps instead: the
        full block becomes matchable after the step that writes it completes, whoever else held it then."""
        size = self.block_size
        entry = CacheEntry(
            state.hashes[index], self._key_namespace(state.namespace), tuple(state.tokens[: (index + 1) * size])
        )
        self._registrations.append(_Registration(self._commit_step(), state, index, twin, state.versions[index], entry))

    def _twin(self, seq: SeqId, state: _Sequence, index: int) -> Optional[int]:
        """Another running sequence's block at ``index`` with the same content (any full one when ``by_index``)."""
        end = (index + 1) * self.block_size
        for other_id, other in self._seqs.items():
            if other_id == seq or other.host_table is not None or len(other.tokens) < end:
                continue
            same = other.namespace == state.namespace and other.tokens[:end] == state.tokens[:end]
            if (same or self._by_index) and other.table[index] != state.table[index]:
                return other.table[index]
        return None


def deduplicating_allocator(spec: PoolSpec) -> PagedAllocator:
    """The correct _DedupesCopiedTail, for the machine."""
    return _DedupesCopiedTail(spec)


def _forks_decode(allocator: PagedAllocator, other: tuple[int, ...] = ()) -> Engine:
    """The v0 program of docs/adapter-findings.md: ``s0`` computed, forked into ``s1`` and ``s1`` into ``s2``, then
    each grows by the same token: ``s0``'s tail is copied into a fresh block, ``s1``'s too, which its grow fills
    with the same content as ``s0``'s, so the allocator maps ``s0``'s block instead. ``other``: a prompt admitted
    first as ``x`` (grown last)."""
    engine = Engine(allocator, CONFIG)
    if other:
        engine.admit("x", (), other)
    engine.admit("s0", (), PROMPT)
    engine.step()
    engine.fork("s0", "s1")
    engine.fork("s1", "s2")
    for seq in ("s0", "s1", "s2"):
        assert engine.grow(seq, (7,))
    return engine


def test_a_declared_deduplicated_copy_is_accepted_and_its_destination_freed() -> None:
    allocator = _DedupesCopiedTail(CONFIG.pool_spec())
    engine = _forks_decode(allocator)
    tables = {seq: engine.expected.seqs[seq].table for seq in ("s0", "s1", "s2")}
    assert tables["s1"][2] == tables["s0"][2] != tables["s2"][2]
    assert engine.stats["copy-on-write copies deduplicated"] == 1
    assert engine.stats["copy-on-write copies"] == 2
    engine.step()  # s0 and s1 write position 23 of their shared block with identical K/V; attention reads all
    assert engine.grow("s1", (8,))  # into a fresh block: logical block 3
    engine.step()
    engine.quiesce()


def test_without_the_declaration_the_dropped_destination_is_still_reported() -> None:
    with pytest.raises(InvariantViolation) as caught:
        _forks_decode(_DedupesCopiedTail(CONFIG.pool_spec(), declare=False))
    violation = caught.value
    assert violation.invariant is Invariant.EXCLUSIVE_WRITES
    assert violation.operation == "grow('s1', (7,))"
    assert "while it is shared" in violation.summary


def test_a_table_mapping_other_content_in_place_of_the_copy_is_caught() -> None:
    """``x`` holds other K/V at logical block 2, and the buggy allocator takes its block for ``s0``."""
    with pytest.raises(InvariantViolation) as caught:
        _forks_decode(_DedupesCopiedTail(CONFIG.pool_spec(), by_index=True), other=(9,) * 24)
    violation = caught.value
    assert violation.invariant is Invariant.CONTENT
    assert violation.operation == "grow('s0', (7,))"
    assert "maps its logical block 2 to block" in violation.summary
    assert "holds another prefix's K/V" in violation.summary


def test_a_copy_into_a_block_another_sequence_references_is_caught() -> None:
    with pytest.raises(InvariantViolation) as caught:
        _forks_decode(_DedupesCopiedTail(CONFIG.pool_spec(), copies_into="x"), other=(9,) * 5)
    violation = caught.value
    assert violation.invariant is Invariant.EXCLUSIVE_WRITES
    assert violation.operation == "grow('s1', (7,))"
    assert "which s1's table does not map after the grow" in violation.summary
    assert "is referenced by [('x', 0)]" in str(violation)


def test_a_dropped_destination_left_out_of_the_free_set_is_caught_at_the_grow() -> None:
    with pytest.raises(InvariantViolation) as caught:
        _forks_decode(_DedupesCopiedTail(CONFIG.pool_spec(), leaks_destination=True))
    violation = caught.value
    assert violation.invariant in (Invariant.REFCOUNTS, Invariant.FREE_SET)
    assert violation.operation == "grow('s1', (7,))"


def test_the_machine_finds_nothing_to_report_in_the_deduplicating_allocator() -> None:
    config = MachineConfig(block_size=2, num_blocks=12, num_host_blocks=0)
    quick = settings(max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck))
    run_state_machine_as_test(machine_for(deduplicating_allocator, config), settings=quick)


def _machine() -> object:
    return machine_for(deduplicating_allocator, MachineConfig(block_size=2, num_blocks=12, num_host_blocks=0))()


def test_a_random_search_s_three_findings_against_the_deduplicating_allocator_stay_fixed() -> None:
    """The programs a CI run's search shrank against this allocator (2026-12-06), each a false report of this module's
    own allocator, each passing now: a dropped destination was taken when the grow evicted a cached block, so it is
    not 'left free' (invariant 13); the block the table maps instead is registered for the cache as the dropped one
    was (14); and, as vLLM v0 declares ``hits_scheduled_writes``, the block found may hold K/V the next step writes
    (1)."""
    state: Any = _machine()
    state.admit(namespace=(), seq="s0", suffix=[0, 0, 0, 0], system=(0, 3, 2, 1))
    state.step()
    state.rollback(num_tokens=3, seq="s0")
    state.admit(namespace=(), seq="s1", suffix=[0], system=(1,))
    state.grow(seq="s1", tokens=[0])
    state.grow(seq="s1", tokens=[0, 0, 0])
    state.admit(namespace=(), seq="s2", suffix=[0], system=())
    state.grow(seq="s1", tokens=[0, 0, 0])
    state.fork(child="s3", parent="s0")
    state.grow(seq="s3", tokens=[0])
    state.grow(seq="s0", tokens=[0, 0])  # reused a cached block while the copy's destination was taken
    state.teardown()

    state = _machine()
    state.admit(namespace=(), seq="s0", suffix=[0, 0, 0, 0], system=(0, 3, 2, 1))
    state.step()
    state.rollback(num_tokens=3, seq="s0")
    state.admit(namespace=(), seq="s1", suffix=[0], system=(1,))
    state.grow(seq="s1", tokens=[0, 0, 0])
    state.admit(namespace=(), seq="s2", suffix=[0], system=())
    state.grow(seq="s1", tokens=[0, 0])
    state.fork(child="s3", parent="s0")
    state.grow(seq="s3", tokens=[0])
    state.grow(seq="s0", tokens=[0, 0])
    state.preempt(seq="s3")
    state.step()
    state.readmit(seq="s3")
    state.grow(seq="s3", tokens=[0])
    state.evict_blocks(blocks=[2])
    state.rollback(num_tokens=3, seq="s0")  # releases the block the table took instead: cached, not freed
    state.teardown()

    state = _machine()
    state.admit(namespace=(), seq="s0", suffix=[0], system=())
    state.step()
    state.admit(namespace=(), seq="s1", suffix=[0], system=())
    state.fork(child="s2", parent="s0")
    state.grow(seq="s1", tokens=[0])
    state.grow(seq="s0", tokens=[0])  # takes s1's block, whose K/V the next step writes
    state.teardown()
