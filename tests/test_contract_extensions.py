"""The optional parts of the contract that real engines need: blocks matchable when scheduled (vLLM), FCFS engines
that never preempt scheduled work, copies ordered by fork, and blocks remapped when a step completes."""

from __future__ import annotations

import pytest
from factories import CopyTailOnFork, declaring

from kvfuzz.allocator import BlockCopy, PagedAllocator, PoolSpec
from kvfuzz.engine import Engine
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.runner import run
from kvfuzz.zoo.variants import FullHitCappedInPlace, MatchableAtAllocation


@pytest.mark.slow
def test_registering_at_allocation_is_sound_when_declared_and_preemption_waits_for_the_step():
    """MatchableAtAllocation behaves as vLLM does; declared so, with an FCFS engine and no rollback (vLLM keeps the
    blocks of rejected drafts), every invariant holds."""
    summary = run(
        declaring(
            MatchableAtAllocation,
            hits_scheduled_writes=True,
            shares_scheduled_blocks=True,
            free_lands_scheduled_writes=True,
            preempt_scheduled=False,
            rollback=False,
        ),
        MachineConfig(),
        examples=300,
    )
    assert not summary.failed, summary.explanation
    assert summary.operations["cache hits"] > 0


def test_withdrawing_scheduled_writes_is_still_caught():
    """If the engine may preempt a request it already scheduled, the blocks registered for its writes are served
    to a later hit with nothing in them."""
    summary = run(
        declaring(
            MatchableAtAllocation,
            hits_scheduled_writes=True,
            shares_scheduled_blocks=True,
            free_lands_scheduled_writes=True,
            preempt_scheduled=True,
        ),
        MachineConfig(),
        examples=300,
    )
    assert summary.failed and summary.violated in (Invariant.CACHE_SOUNDNESS, Invariant.CONTENT)


def test_rolling_back_scheduled_tokens_of_a_registered_block_is_caught():
    """Bug class 8 meets class 5: a rollback drops scheduled tokens of a block already registered, so a hit on it
    covers positions nobody will write."""
    summary = run(
        declaring(
            MatchableAtAllocation,
            hits_scheduled_writes=True,
            shares_scheduled_blocks=True,
            free_lands_scheduled_writes=True,
            preempt_scheduled=False,
        ),
        MachineConfig(),
        examples=300,
    )
    assert summary.failed and summary.violated is Invariant.CACHE_SOUNDNESS
    assert "rollback" in summary.program


def test_undeclared_early_registration_remains_a_bug():
    summary = run(declaring(MatchableAtAllocation), MachineConfig(), examples=300)
    assert summary.failed and summary.violated is Invariant.CACHE_SOUNDNESS


def test_a_same_round_hit_shares_the_block_its_owner_writes():
    allocator = declaring(
        MatchableAtAllocation,
        hits_scheduled_writes=True,
        shares_scheduled_blocks=True,
        free_lands_scheduled_writes=True,
    )(PoolSpec(4, 8))
    engine = Engine(allocator, MachineConfig(block_size=4, num_blocks=8, num_host_blocks=0))
    assert engine.admit("a", (), (1, 2, 3, 4, 5))
    assert engine.admit("b", (), (1, 2, 3, 4, 6))
    assert (
        engine.expected.seqs["b"].written == 4
        and engine.expected.seqs["b"].table[0] == engine.expected.seqs["a"].table[0]
    )
    engine.step()  # a writes block 0, which b matched: identical content, so no exclusive-write violation
    engine.quiesce()


class _BogusForkCopy(CopyTailOnFork):
    """Copies the tail, yet reports the copy into a block the child does not hold."""

    def fork(self, parent, child):
        copies = super().fork(parent, child)
        return copies and [BlockCopy(copies[0].src, self.block_table(parent)[0])]


class _RemapsToAStranger(PagedAllocator):
    """Declares remaps_on_step, then points the first block of one sequence at another sequence's block."""

    def step_completed(self, step):
        super().step_completed(step)
        live = [seq for seq, state in self._seqs.items() if state.table]
        if len(live) >= 2 and self._seqs[live[0]].table[0] != self._seqs[live[1]].table[0]:
            self._seqs[live[0]].table[0] = self._seqs[live[1]].table[0]


@pytest.mark.parametrize("window", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_correct_copying_fork_passes(window):
    summary = run(declaring(CopyTailOnFork, window, fork_copies=True), MachineConfig(), examples=200)
    assert not summary.failed, summary.explanation
    assert summary.operations["fork copies"] > 0


def test_fork_copies_must_be_declared():
    summary = run(declaring(CopyTailOnFork), MachineConfig(), examples=200)
    assert summary.failed and summary.violated is Invariant.REFCOUNTS
    assert "does not declare fork_copies" in summary.explanation


def test_a_copy_into_a_block_the_child_does_not_hold_is_caught():
    summary = run(declaring(_BogusForkCopy, fork_copies=True), MachineConfig(), examples=200)
    assert summary.failed and summary.violated is Invariant.REFCOUNTS, summary.explanation


def test_a_remap_to_another_prefix_is_caught_bit_for_bit():
    allocator = declaring(_RemapsToAStranger, remaps_on_step=True)(PoolSpec(4, 8))
    engine = Engine(allocator, MachineConfig(block_size=4, num_blocks=8, num_host_blocks=0))
    engine.admit("a", (), (1, 2, 3, 4))
    engine.admit("b", (), (5, 6, 7, 8))
    with pytest.raises(InvariantViolation) as caught:
        engine.step()
    assert caught.value.invariant is Invariant.CONTENT


def test_a_sharing_allocator_may_not_refuse_a_fork_on_a_full_pool():
    """A fork that shares every block needs no free block: refusing it is a false refusal."""

    class RefusesForkWhenFull(PagedAllocator):
        def fork(self, parent, child):
            if parent in self._seqs and child not in self._seqs and not self.free_blocks():
                self._check_room(1)
            return super().fork(parent, child)

    # A full pool is the trigger: an 8-block pool gets there in a few examples, the default 16 in a few hundred.
    summary = run(declaring(RefusesForkWhenFull), MachineConfig(num_blocks=8), examples=300)
    assert summary.failed and summary.violated is Invariant.NO_FALSE_REFUSAL, summary.explanation


def test_rewriting_shared_cached_content_needs_its_own_declaration():
    """Bug class 9 stays caught under same-round sharing: a full-prompt hit capped in place rewrites a block
    other sequences read; only an allocator declaring recomputes_in_place (vLLM v0) may do that."""
    for capabilities, caught in (
        ({"shares_scheduled_blocks": True}, True),
        ({"shares_scheduled_blocks": True, "recomputes_in_place": True}, False),
    ):
        allocator = declaring(FullHitCappedInPlace, **capabilities)(PoolSpec(4, 8))
        engine = Engine(allocator, MachineConfig(block_size=4, num_blocks=8, num_host_blocks=0))
        engine.admit("a", (), (1, 2, 3, 4))
        engine.step()
        if caught:
            with pytest.raises(InvariantViolation) as violation:
                engine.admit("b", (), (1, 2, 3, 4))
            assert violation.value.invariant is Invariant.EXCLUSIVE_WRITES
        else:
            engine.admit("b", (), (1, 2, 3, 4))
            engine.step()
            engine.quiesce()


def test_a_hit_on_scheduled_content_is_not_computed_until_the_step():
    """Its K/V does not exist yet: it may not be swapped out or forked before the step that writes it."""
    allocator = declaring(
        MatchableAtAllocation,
        hits_scheduled_writes=True,
        shares_scheduled_blocks=True,
        free_lands_scheduled_writes=True,
    )(PoolSpec(4, 8, 2))
    engine = Engine(allocator, MachineConfig(block_size=4, num_blocks=8, num_host_blocks=2))
    engine.admit("a", (), (1, 2, 3, 4))
    engine.admit("b", (), (1, 2, 3, 4, 5))
    assert "b" not in engine.expected.computed_ids()
    engine.step()
    assert {"a", "b"} <= set(engine.expected.computed_ids())
