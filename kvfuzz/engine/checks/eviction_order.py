"""Invariant 13, eviction order (a declared policy): the cached blocks an operation evicts or reuses are the least
recently released ones, and none while a free block is left. Its snapshot before an operation also ends the
complete-caching debt of the blocks that leave the cache."""

from __future__ import annotations

from typing import Iterable, Optional

import attrs

from kvfuzz.engine.checks.context import Checker
from kvfuzz.engine.violations import Cause, Invariant


@attrs.frozen
class CacheSnapshot:
    """The allocator's cached and free blocks before an operation, and every unreferenced block in the order it was
    released (the engine's own record, tail blocks of one release first): what the eviction-order check compares
    the operation's evictions against."""

    cached: tuple[int, ...]  # cached blocks, in the allocator's order
    free: frozenset[int]  # free blocks
    recency: tuple[int, ...]  # unreferenced blocks, least recently released first


class EvictionOrder(Checker):
    """Invariant 13 on the blocks that left the cached set during one operation, against a snapshot taken before
    it."""

    def snapshot(self) -> Optional[CacheSnapshot]:
        """What the eviction-order and complete-caching checks need before an operation that may evict, or None when
        neither policy is declared (or the allocator cannot show its sets)."""
        alloc = self.introspection
        if alloc is None or (self.state.caps.eviction_order is None and not self.context.owes_caching()):
            return None
        return CacheSnapshot(
            tuple(alloc.cached_blocks()), frozenset(alloc.free_blocks()), tuple(self.state.refs.released)
        )

    def evictions(
        self, before: Optional[CacheSnapshot], hits: Iterable[int], reuse: bool, given_back: Iterable[int] = ()
    ) -> None:
        """The cached blocks an operation evicted or reused (every block that left the cached set, other than by a
        hit): the complete-caching debt for them ends, and invariant 13 holds of them. Invariant 13: they are the
        least recently released ones, and, when the operation handed them out for new content (``reuse``), no block
        that was free before it is still free, but those it took and ``given_back`` within it (a deduplicated copy's
        destination: taken for the copy, so not free when the grow evicted, and free again after it)."""
        alloc = self.introspection
        if before is None or alloc is None:
            return
        hit = set(hits)
        cached_after = set(alloc.cached_blocks())
        gone = [block for block in before.cached if block not in cached_after and block not in hit]
        self.state.matchable.forget(gone)
        if not gone or self.state.caps.eviction_order is None:
            return
        was_cached = set(before.cached) - hit
        known = [block for block in before.recency if block in was_cached]
        released = set(known)  # a cached block the engine never saw released is counted oldest
        order = [block for block in before.cached if block in was_cached and block not in released] + known
        oldest = order[: len(gone)]
        if set(gone) != set(oldest):
            wrong = next(block for block in gone if block not in oldest)
            skipped = next(block for block in oldest if block not in gone)
            self.fail(
                Invariant.EVICTION_ORDER,
                f"{'reused' if reuse else 'evicted'} cached block {wrong} before block {skipped}, which was released "
                "earlier",
                [
                    f"expected: least recently released first (LRU; a release frees its tail blocks first): {oldest}",
                    f"found:    {'reused' if reuse else 'evicted'} {gone}",
                    f"cached blocks, least recently released first: {order}",
                    *self.pools.block_story(wrong),
                    *self.pools.block_story(skipped),
                ],
                Cause("cached blocks evicted out of least-recently-released order"),
            )
        still_free = sorted((before.free & set(alloc.free_blocks())) - set(given_back)) if reuse else []
        if still_free:
            self.fail(
                Invariant.EVICTION_ORDER,
                f"reused cached block {gone[0]} for new content while block {still_free[0]} was free",
                [
                    "expected: a cached block is evicted for new content only once no free block is left",
                    f"found:    reused {gone}; still free: {still_free}",
                    *self.pools.block_story(gone[0]),
                    *self.pools.block_story(still_free[0]),
                ],
                Cause("a cached block reused for new content while a free block was left"),
            )
