"""What kvfuzz's own allocators share: one :class:`~kvfuzz.allocator.block_pool.BlockPool` with its
:class:`~kvfuzz.allocator.prefix_cache.PrefixCache`, the registrations that make blocks matchable when a step
completes, eviction, and the introspection queries, all answered by the pool.

:class:`~kvfuzz.allocator.paged.PagedAllocator` (one block table per sequence) and
:class:`~kvfuzz.allocator.hybrid.HybridAllocator` (one per KV-cache group) differ in their tables, not in this.
"""

from __future__ import annotations

from collections import deque
from typing import Collection, Protocol, Sequence

from kvfuzz.allocator.block_pool import BlockPool
from kvfuzz.allocator.errors import InvalidArgument
from kvfuzz.allocator.prefix_cache import CacheEntry, PrefixCache


class Registration(Protocol):
    """A block to make matchable as ``entry`` once step ``commit_after`` has completed, if its writer still maps it
    then (``still_valid``)."""

    @property
    def commit_after(self) -> int: ...

    @property
    def block(self) -> int: ...

    @property
    def entry(self) -> CacheEntry: ...

    def still_valid(self) -> bool: ...


class PooledAllocator:
    """The pool-facing half of kvfuzz's allocators; a subclass builds the three fields in its ``__init__``.

    Invariant kept: ``_registrations`` is in order of ``commit_after`` (each is queued with the step the next launch
    will be, which never decreases), so the registrations due at a step completion are a prefix of the queue.
    """

    num_blocks: int
    _cache: PrefixCache  # hash -> cached blocks; unregisters a block when the pool evicts it
    _pool: BlockPool  # refcounts, free, cached (evictable) and pending blocks, LRU order, the in-flight window
    _registrations: deque[Registration]  # blocks to make matchable when their writing step completes

    def evict(self, num_blocks: int) -> int:
        if num_blocks < 0:
            raise InvalidArgument(f"evict: cannot evict {num_blocks} blocks")
        return self._pool.evict(num_blocks)

    def reset_cache(self) -> None:
        self._pool.evict(self.num_blocks)

    def evict_blocks(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if not 0 <= block < self.num_blocks:
                raise InvalidArgument(f"evict_blocks: block {block} is outside the pool")
        for block in blocks:
            self._pool.evict_block(block)

    def step_completed(self, step: int) -> None:
        if step <= self._pool.last_completed_step:
            raise InvalidArgument(f"step_completed({step}) after step {self._pool.last_completed_step} completed")
        self._pool.step_completed(step)
        while self._registrations and self._registrations[0].commit_after <= step:
            registration = self._registrations.popleft()
            if registration.still_valid():
                self._cache.register(registration.block, registration.entry)

    # -- introspection -------------------------------------------------------------------------------------------

    def refcount(self, block: int) -> int:
        return self._pool.refcount(block)

    def free_blocks(self) -> Collection[int]:
        return self._pool.free_blocks()

    def cached_blocks(self) -> Collection[int]:
        return self._pool.evictable_blocks()

    def pending_blocks(self) -> Collection[int]:
        return self._pool.pending_blocks()
