"""Broken evictions: kvfuzz's correct allocator with one slip in how it drops cached blocks, each caught by the
check of the eviction capability or policy it declares (docs/contract.md).

The variants exist to prove, in the test suite, that each eviction check can fail. Never use them for anything else.
"""

from __future__ import annotations

from typing import Sequence

import attrs

from kvfuzz.allocator.block_pool import BlockPool
from kvfuzz.allocator.paged import PagedAllocator
from kvfuzz.allocator.prefix_cache import CacheEntry
from kvfuzz.allocator.types import GrowResult, SeqId, Tokens
from kvfuzz.engine.violations import Invariant
from kvfuzz.zoo.entry import Variant


class SubtreeEvictor(PagedAllocator):
    """A correct allocator whose ``evict(n)`` rounds up to whole cached subtrees, as SGLang's ``RadixCache.evict``
    drops whole leaves: it takes the least recently released cached block and every cached block whose prefix
    extends that block's, and repeats until at least ``n`` blocks are gone or nothing is cached. Declares
    ``evict_rounds_up``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.capabilities = attrs.evolve(self.capabilities, evict_rounds_up=True)

    def evict(self, num_blocks: int) -> int:
        dropped = 0
        while dropped < num_blocks and self.cached_blocks():
            dropped += self._evict_subtree()
            if self._one_subtree_only:
                break
        return dropped

    _one_subtree_only = False  # the slip of EvictsOneSubtree

    def _evict_subtree(self) -> int:
        """Evict the least recently released cached block and every cached block below it; return how many."""
        root = next(iter(self.cached_blocks()))
        root_entry = self._entry(root)
        subtree = [
            block
            for block in list(self.cached_blocks())
            if block == root or self._extends(self._entry(block), root_entry)
        ]
        for block in subtree:
            self._pool.evict_block(block)
        return len(subtree)

    def _entry(self, block: int) -> CacheEntry:
        return self._cache._entry_by_block[block]

    @staticmethod
    def _extends(entry: CacheEntry, root: CacheEntry) -> bool:
        return entry.namespace == root.namespace and entry.prefix[: len(root.prefix)] == root.prefix


class EvictsOneSubtree(SubtreeEvictor):
    """Rounding eviction that stops short: ``evict(n)`` drops one whole cached subtree and returns, even when that
    subtree holds fewer than ``n`` blocks and more are cached, as a leaf-eviction loop whose exit test is written
    ``if evicted: break`` instead of ``while evicted < n``. Caught by invariant 4 under ``evict_rounds_up``."""

    _one_subtree_only = True


class EvictBlocksKeepsEntry(PagedAllocator):
    """Targeted eviction that forgets the hash map: ``evict_blocks`` moves each named cached block to the free queue
    but leaves its prefix-cache entry in place, so a later hit runs on through the evicted block in the middle of
    its chain (and, once the block is handed out again, into someone else's K/V), as a KV connector's invalid-block
    eviction that updates the free queue and not the lookup table. Caught by invariant 9."""

    def evict_blocks(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if block in self._pool._evictable:
                del self._pool._evictable[block]
                self._pool._free[block] = None


class _MostRecentFirstPool(BlockPool):
    """Hands out the most recently released cached block first once no free block is left."""

    def _next_evictable(self) -> int:
        return next(reversed(self._evictable))


class EvictsMostRecentFirst(PagedAllocator):
    """LRU declared, MRU done: under pressure the allocator reuses the most recently released cached block, as a
    free queue that pushes cached blocks at the head instead of the tail (the reuse order vLLM keeps for uncached
    blocks, applied to cached ones). Every hit stays sound; what is lost is the prefix most likely to be asked for
    again. Caught by invariant 13 (eviction order)."""

    pool_class = _MostRecentFirstPool


class CachesPromptBlocksOnly(PagedAllocator):
    """Complete caching declared, prompts cached only: blocks filled by decode or later chunks are never registered,
    as a cache that hashes a request's blocks once, at admission, and forgets the tokens it generates. Every hit is
    sound; a later request with the grown prefix recomputes what the cache should have served. Caught by invariant
    14 (complete caching)."""

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        queued = len(self._registrations)
        result = super().grow(seq, tokens)
        while len(self._registrations) > queued:
            self._registrations.pop()
        return result


VARIANTS: tuple[Variant, ...] = (
    Variant(
        EvictsOneSubtree,
        "rounding eviction stops short",
        Invariant.FREE_SET,
        cause="evict_rounds_up drops whole cached subtrees",
    ),
    Variant(
        EvictBlocksKeepsEntry,
        "targeted eviction keeps the cache entry",
        Invariant.CACHE_SOUNDNESS,
        cause="which an eviction dropped from the cache",
    ),
    Variant(
        EvictsMostRecentFirst,
        "most recently used evicted first",
        Invariant.EVICTION_ORDER,
        cause="which was released earlier",
    ),
    Variant(
        CachesPromptBlocksOnly,
        "generated blocks never cached",
        Invariant.COMPLETE_CACHING,
        cause="its prefix was never registered",
    ),
)
"""This module's slips, in the zoo's order, each with its bug class and the invariant that must catch it."""
