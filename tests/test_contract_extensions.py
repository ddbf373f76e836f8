"""The optional parts of the contract that real engines need: blocks matchable when scheduled (vLLM), FCFS engines
that never preempt scheduled work, copies ordered by fork, and blocks remapped when a step completes."""

from __future__ import annotations

import attrs
import pytest

from kvfuzz.allocator import BlockCopy, PagedAllocator, PoolSpec
from kvfuzz.runner import run
from kvfuzz.statemachines.config import MachineConfig
from kvfuzz.statemachines.harness import Harness
from kvfuzz.statemachines.violations import Invariant, InvariantViolation
from kvfuzz.zoo.variants import MatchableAtAllocation


def _declaring(cls: type, **capabilities: object):
    def factory(spec: PoolSpec) -> PagedAllocator:
        allocator = cls(spec.block_size, spec.num_blocks, spec.num_host_blocks, inflight_window=0)
        allocator.capabilities = attrs.evolve(allocator.capabilities, **capabilities)
        return allocator

    factory.__name__ = f"{cls.__name__}_{'_'.join(f'{k}_{v}' for k, v in capabilities.items())}"
    return factory


def test_registering_at_allocation_is_sound_when_declared_and_preemption_waits_for_the_step():
    """MatchableAtAllocation behaves as vLLM does; declared so, with an FCFS engine and no rollback (vLLM keeps the
    blocks of rejected drafts), every invariant holds."""
    summary = run(_declaring(MatchableAtAllocation, matchable_when_scheduled=True, preempt_scheduled=False,
                             rollback=False), MachineConfig(), examples=300)
    assert not summary.failed, summary.explanation
    assert summary.operations["cache hits"] > 0


def test_withdrawing_scheduled_writes_is_still_caught():
    """If the engine may preempt a request it already scheduled, the blocks registered for its writes are served
    to a later hit with nothing in them."""
    summary = run(_declaring(MatchableAtAllocation, matchable_when_scheduled=True, preempt_scheduled=True),
                  MachineConfig(), examples=300)
    assert summary.failed and summary.invariant in ("invariant 9 (cache soundness)", "invariant 1 (content)")


def test_rolling_back_scheduled_tokens_of_a_registered_block_is_caught():
    """Bug class 8 meets class 5: a rollback drops scheduled tokens of a block already registered, so a hit on it
    covers positions nobody will write."""
    summary = run(_declaring(MatchableAtAllocation, matchable_when_scheduled=True, preempt_scheduled=False),
                  MachineConfig(), examples=300)
    assert summary.failed and summary.invariant == "invariant 9 (cache soundness)"
    assert "rollback" in summary.program


def test_undeclared_early_registration_remains_a_bug():
    summary = run(_declaring(MatchableAtAllocation), MachineConfig(), examples=300)
    assert summary.failed and summary.invariant == "invariant 9 (cache soundness)"


def test_a_same_round_hit_shares_the_block_its_owner_writes():
    allocator = _declaring(MatchableAtAllocation, matchable_when_scheduled=True)(PoolSpec(4, 8))
    harness = Harness(allocator, MachineConfig(block_size=4, num_blocks=8, num_host_blocks=0))
    assert harness.admit("a", (), (1, 2, 3, 4, 5))
    assert harness.admit("b", (), (1, 2, 3, 4, 6))
    assert harness.seqs["b"].written == 4 and harness.seqs["b"].table[0] == harness.seqs["a"].table[0]
    harness.step()  # a writes block 0, which b matched: identical content, so no exclusive-write violation
    harness.quiesce()


class _BogusForkCopy(PagedAllocator):
    """Shares every block, yet reports a copy into a block the child does not hold."""

    def fork(self, parent, child):
        super().fork(parent, child)
        return [BlockCopy(self.block_table(parent)[-1], next(iter(self.free_blocks())))]


class _RemapsToAStranger(PagedAllocator):
    """Declares remaps_on_step, then points the first block of one sequence at another sequence's block."""

    def step_completed(self, step):
        super().step_completed(step)
        live = [seq for seq, state in self._seqs.items() if state.table]
        if len(live) >= 2 and self._seqs[live[0]].table[0] != self._seqs[live[1]].table[0]:
            self._seqs[live[0]].table[0] = self._seqs[live[1]].table[0]


@pytest.mark.parametrize("cls, capabilities", [(_BogusForkCopy, {}), (_RemapsToAStranger, {"remaps_on_step": True})])
def test_a_wrong_copy_or_remap_is_caught(cls, capabilities):
    summary = run(_declaring(cls, **capabilities), MachineConfig(), examples=300)
    assert summary.failed and summary.invariant.startswith("invariant"), summary.explanation


def test_a_remap_is_checked_bit_for_bit():
    allocator = _declaring(_RemapsToAStranger, remaps_on_step=True)(PoolSpec(4, 8))
    harness = Harness(allocator, MachineConfig(block_size=4, num_blocks=8, num_host_blocks=0))
    harness.admit("a", (), (1, 2, 3, 4))
    harness.admit("b", (), (5, 6, 7, 8))
    with pytest.raises(InvariantViolation) as caught:
        harness.step()
    assert caught.value.invariant in (Invariant.CONTENT, Invariant.REFCOUNTS, Invariant.FREE_SET)
