"""The physical block pool of kvfuzz's own allocator: refcounts, the free queue, the evictable LRU and the
in-flight window.

Every block is in exactly one of four states:

* referenced: ``refcount > 0``; in no queue;
* free: unreferenced and holding nothing reusable; in ``_free`` (FIFO);
* evictable: unreferenced and holding cached K/V; in ``_evictable``, least recently used first;
* pending: released while work that may still touch it is in flight; in ``_pending`` with the step after whose
  completion it may be handed out again.

Handing out prefers free blocks and only then evicts the least recently used cached one.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Collection

from kvfuzz.allocator.errors import OutOfBlocks


class BlockPool:
    """Refcounted blocks ``0 .. num_blocks - 1`` with a non-reuse window of ``inflight_window`` steps."""

    def __init__(
        self, num_blocks: int, inflight_window: int, is_cached: Callable[[int], bool], on_evict: Callable[[int], None]
    ) -> None:
        self.num_blocks = num_blocks
        self.inflight_window = inflight_window
        self._is_cached = is_cached
        self._on_evict = on_evict
        self._refcount = [0] * num_blocks
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))
        self._evictable: dict[int, None] = {}
        self._pending: dict[int, int] = {}
        self._pending_order: deque[tuple[int, int]] = deque()
        self.last_completed_step = -1

    # -- queries -------------------------------------------------------------------------------------------------

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def free_blocks(self) -> Collection[int]:
        return self._free.keys()

    def evictable_blocks(self) -> Collection[int]:
        return self._evictable.keys()

    def pending_blocks(self) -> Collection[int]:
        return self._pending.keys()

    def num_available(self) -> int:
        """Blocks that could be handed out now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    # -- references ----------------------------------------------------------------------------------------------

    def allocate(self, count: int, reserve: int = 0) -> list[int]:
        """Hand out ``count`` fresh blocks, evicting cached ones if needed; all or nothing."""
        available = self.num_available()
        if count + reserve > available:
            raise OutOfBlocks(
                f"need {count} block(s) (+{reserve} reserved), {available} available", needed=count, available=available
            )
        blocks = []
        for _ in range(count):
            if self._free:
                block = next(iter(self._free))
                del self._free[block]
            else:
                block = self._next_evictable()
                del self._evictable[block]
                self._on_evict(block)
            self._refcount[block] = 1
            blocks.append(block)
        return blocks

    def _next_evictable(self) -> int:
        """The cached block ``allocate`` reuses once no free block is left: the least recently released."""
        return next(iter(self._evictable))

    def take(self, block: int) -> None:
        """Add a reference to ``block`` (a prefix-cache hit or a fork); an unreferenced block leaves its queue, and a
        pending one its place in the settling order too, so that its next release queues it as the most recent."""
        if self._refcount[block] == 0:
            self._evictable.pop(block, None)
            until = self._pending.pop(block, None)
            if until is not None:
                self._pending_order.remove((until, block))
        self._refcount[block] += 1

    def release(self, block: int) -> None:
        """Drop one reference; the last one sends the block to pending, or straight on if the window is zero."""
        self._refcount[block] -= 1
        if self._refcount[block] > 0:
            return
        until = self.last_completed_step + self.inflight_window
        if until <= self.last_completed_step:
            self._settle(block)
        else:
            self._pending[block] = until
            self._pending_order.append((until, block))

    def step_completed(self, step: int) -> None:
        """Settle every pending block whose window has closed."""
        self.last_completed_step = step
        while self._pending_order and self._pending_order[0][0] <= step:
            until, block = self._pending_order.popleft()
            if self._pending.get(block) == until:
                del self._pending[block]
                self._settle(block)

    def _settle(self, block: int) -> None:
        if self._is_cached(block):
            self._evictable[block] = None
        else:
            self._free[block] = None

    # -- cache maintenance ---------------------------------------------------------------------------------------

    def evict_block(self, block: int) -> None:
        """Drop ``block``'s cache entry if it has one; an evictable block becomes free, a pending one settles as free.
        A referenced block is left alone."""
        if self._refcount[block] > 0:
            return
        if block in self._evictable:
            del self._evictable[block]
            self._free[block] = None
        self._on_evict(block)

    def evict(self, count: int) -> int:
        """Drop up to ``count`` least recently used evictable blocks; return how many."""
        dropped = 0
        while self._evictable and dropped < count:
            block = next(iter(self._evictable))
            del self._evictable[block]
            self._on_evict(block)
            self._free[block] = None
            dropped += 1
        return dropped
