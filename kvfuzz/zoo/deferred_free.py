"""Zoo variants whose slip is in deferred freeing: the work a completing step does, which kvfuzz checks right after
``step_completed`` so that the blame lands on the step that settled the blocks, not on a later call."""

from __future__ import annotations

from kvfuzz.allocator.block_pool import BlockPool
from kvfuzz.allocator.paged import PagedAllocator
from kvfuzz.engine.violations import Invariant
from kvfuzz.zoo.entry import Variant


class _SettlesStaleEntries(BlockPool):
    """Settles every deferred-free entry that comes due, without asking whether the block still waits on it; a
    pending block taken again keeps its entry in the settling order."""

    def take(self, block: int) -> None:
        if self.refcount(block) == 0:
            self._evictable.pop(block, None)
            self._pending.pop(block, None)
        self._refcount[block] += 1

    def step_completed(self, step: int) -> None:
        self.last_completed_step = step
        while self._pending_order and self._pending_order[0][0] <= step:
            _, block = self._pending_order.popleft()
            self._pending.pop(block, None)
            self._settle(block)


class StaleDeferredFree(PagedAllocator):
    """Class 3, a deferred free that fires for a block referenced again since: the deferred-free queue keeps one
    entry per release and, when an entry comes due, returns its block to the pool without checking that the block
    is still waiting on that release. A block released, then matched by a prefix-cache hit inside its window, is
    put back in the cached set while the new request holds it (or, released again, before its newer window
    closes), as a free list without a generation check does.
    """

    pool_class = _SettlesStaleEntries


VARIANTS: tuple[Variant, ...] = (
    Variant(
        StaleDeferredFree, "3 stale deferred free", Invariant.FREE_SET, inflight_window=2, cause="yet listed as cached"
    ),
)
"""This module's slips, in the zoo's order, each with its bug class and the invariant that must catch it."""
