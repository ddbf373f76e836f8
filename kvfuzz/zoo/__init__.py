"""The zoo: broken allocators, each one realistic slip away from kvfuzz's correct allocator, with the invariant
kvfuzz must name when it catches it.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import attrs

from kvfuzz.allocator.hybrid import HybridAllocator
from kvfuzz.allocator.paged import PagedAllocator
from kvfuzz.allocator.types import PoolSpec
from kvfuzz.engine.violations import Invariant
from kvfuzz.zoo import cache_keys, contract, deep, deferred_free, eviction, host_pool, hybrid, lookahead, variants

ZooAllocator = Union[PagedAllocator, HybridAllocator]
"""What a zoo variant subclasses: kvfuzz's allocator, or its hybrid (KV-cache groups) allocator."""


@attrs.frozen
class Variant:
    """One broken allocator: its class, the bug class (docs/invariants.md) it belongs to, the invariant that must
    catch it, the in-flight window it declares and, for sliding-window slips, its window in tokens; for look-ahead
    slips, its look-ahead blocks. A deep variant (:mod:`kvfuzz.zoo.deep`) is one the default ``kvfuzz run`` misses
    in most seeds: its trigger needs pool pressure, a long program, a rollback or swap at a particular moment, or a
    tiny pool."""

    allocator: type[ZooAllocator]
    bug_class: str
    expected: Invariant
    inflight_window: int = 1
    sliding_window: Optional[int] = None
    deep: bool = False  # reached by campaigns (swarmed pools, long programs), rarely by a default run
    lookahead_blocks: int = 0  # the look-ahead it allocates and declares (look-ahead slips)

    @property
    def name(self) -> str:
        return self.allocator.__name__

    @property
    def description(self) -> str:
        return " ".join((self.allocator.__doc__ or "").split())

    def factory(self) -> Callable[[PoolSpec], ZooAllocator]:
        def build(spec: PoolSpec) -> ZooAllocator:
            return self.allocator(
                spec.block_size,
                spec.num_blocks,
                spec.num_host_blocks,
                inflight_window=self.inflight_window if spec.inflight_window is None else spec.inflight_window,
                sliding_window=self.sliding_window,
                lookahead_blocks=self.lookahead_blocks,
            )

        build.__name__ = self.name
        return build


VARIANTS: tuple[Variant, ...] = (
    Variant(variants.KeyWithoutNamespace, "1 incomplete cache key", Invariant.CACHE_SOUNDNESS),
    Variant(variants.KeyConcatenatesNamespace, "1 ambiguous cache key", Invariant.CACHE_SOUNDNESS),
    Variant(variants.LeakOnCancel, "2 leak on cancel", Invariant.FREE_SET),
    Variant(variants.OpaqueLeakOnCancel, "2 leak on cancel", Invariant.QUIESCENCE),
    Variant(variants.ImmediateReuse, "3 reuse before in-flight work finished", Invariant.NON_REUSE_WINDOW),
    Variant(variants.DroppedDeferredFree, "3 dropped deferred free", Invariant.FREE_SET, inflight_window=2),
    Variant(variants.FreeForgetsSharedRefcount, "4 refcount under-count", Invariant.REFCOUNTS),
    Variant(variants.ReleasedTwiceOnPreempt, "4 double free", Invariant.REFCOUNTS),
    Variant(variants.MatchableAtAllocation, "5 matchable before written", Invariant.CACHE_SOUNDNESS),
    Variant(variants.LeakyRefusal, "6 accounting drift", Invariant.ATOMIC_REFUSAL),
    Variant(variants.FalseOutOfBlocks, "6 accounting drift", Invariant.NO_FALSE_REFUSAL),
    Variant(variants.NonAtomicHostRefusal, "6 accounting drift", Invariant.ATOMIC_REFUSAL),
    Variant(variants.UnlockedPrefix, "7 matched prefix not locked", Invariant.REFCOUNTS),
    Variant(variants.RollbackKeepsStaleBlock, "8 rollback leaves stale state", Invariant.REFCOUNTS),
    Variant(
        variants.FullHitCappedInPlace, "9 full-prompt hit edge case", Invariant.EXCLUSIVE_WRITES, inflight_window=0
    ),
    Variant(variants.NoCopyOnWrite, "10 copy-on-write missing", Invariant.EXCLUSIVE_WRITES),
    Variant(variants.CopiesWrongBlock, "10 copy-on-write copies the wrong block", Invariant.CONTENT),
    Variant(variants.SwapInWrongHostBlock, "swap-in maps the wrong host block", Invariant.CONTENT),
    Variant(variants.SilentDoubleFree, "misuse accepted silently", Invariant.MISUSE),
    Variant(
        variants.WindowDropIgnoresSharing,
        "11 sliding window drops a shared block",
        Invariant.REFCOUNTS,
        sliding_window=9,
    ),
    Variant(variants.RepeatedBlockAfterRollback, "4 repeated block freed per occurrence", Invariant.REFCOUNTS),
    Variant(variants.ReturnsNoneWhenFull, "6 refusal returned, not raised", Invariant.RESULTS),
    Variant(deferred_free.StaleDeferredFree, "3 stale deferred free", Invariant.FREE_SET, inflight_window=2),
    Variant(host_pool.HostLeakOnFreeSwapped, "2 host blocks leaked on cancel", Invariant.FREE_SET),
    Variant(cache_keys.CollidingBlockKey, "1 colliding cache key", Invariant.CACHE_SOUNDNESS),
    Variant(
        deep.StaleEntryAfterPressureEviction,
        "1 stale cache entry after eviction under pressure",
        Invariant.CACHE_SOUNDNESS,
        deep=True,
    ),
    Variant(deep.SwapInTakesPendingBlocks, "3 swap-in takes pending blocks", Invariant.NON_REUSE_WINDOW, deep=True),
    Variant(
        deep.CachedTailWrittenInPlace,
        "8 rollback leaves a cached block writable",
        Invariant.CACHE_SOUNDNESS,
        deep=True,
    ),
    Variant(
        deep.SwapInRefusalReleasesHost,
        "6 refused swap-in frees its host blocks",
        Invariant.ATOMIC_REFUSAL,
        deep=True,
    ),
    Variant(deep.AbortWhileSwappedLeaksHost, "2 host blocks leaked on abort", Invariant.FREE_SET, deep=True),
    Variant(deep.WholePoolPromptRefused, "6 whole-pool prompt refused", Invariant.NO_FALSE_REFUSAL, deep=True),
    Variant(deep.TrustsShortBlockHash, "1 short hash trusted", Invariant.CACHE_SOUNDNESS, deep=True),
    Variant(
        deep.RollbackKeepsPendingRegistration,
        "5 rollback keeps a pending registration",
        Invariant.CACHE_SOUNDNESS,
        deep=True,
    ),
    Variant(contract.PreemptUnsupported, "engine without preemption, undeclared", Invariant.MISUSE),
    Variant(contract.OneBlockPerGrow, "decode-only grow, undeclared", Invariant.REFCOUNTS),
    Variant(contract.FullPromptHit, "9 hit covers the whole prompt", Invariant.CACHE_SOUNDNESS),
    Variant(contract.EvictsOnRefusal, "6 refusal that evicts, undeclared", Invariant.ATOMIC_REFUSAL),
    Variant(contract.RefusalEvictsReferenced, "6 refusal that evicts a referenced block", Invariant.ATOMIC_REFUSAL),
    Variant(contract.ScheduledHitUnshared, "5 scheduled hit without same-round sharing", Invariant.EXCLUSIVE_WRITES),
    Variant(contract.AbortKeepsScheduledHash, "5 withdrawn writes stay matchable", Invariant.CACHE_SOUNDNESS),
    Variant(
        lookahead.LookaheadSharedByFork,
        "8 look-ahead block shared with a fork sibling",
        Invariant.EXCLUSIVE_WRITES,
        lookahead_blocks=1,
    ),
    Variant(
        lookahead.LookaheadKeepsCachedBlock,
        "8 rollback keeps cached content as look-ahead",
        Invariant.CACHE_SOUNDNESS,
        lookahead_blocks=2,
    ),
    Variant(lookahead.LookaheadLeakOnFree, "2 look-ahead leaked on free", Invariant.REFCOUNTS, lookahead_blocks=1),
    Variant(
        lookahead.RollbackDropsAcceptedBlock,
        "8 rollback frees a block holding accepted tokens",
        Invariant.CONTENT,
        lookahead_blocks=2,
    ),
    Variant(eviction.EvictsOneSubtree, "rounding eviction stops short", Invariant.FREE_SET),
    Variant(eviction.EvictBlocksKeepsEntry, "targeted eviction keeps the cache entry", Invariant.CACHE_SOUNDNESS),
    Variant(eviction.EvictsMostRecentFirst, "most recently used evicted first", Invariant.EVICTION_ORDER),
    Variant(eviction.CachesPromptBlocksOnly, "generated blocks never cached", Invariant.COMPLETE_CACHING),
    Variant(hybrid.HybridHitFromFullGroup, "9 hybrid hit taken from the full group alone", Invariant.CACHE_SOUNDNESS),
    Variant(hybrid.BlockInBothGroups, "11 one block in two KV-cache groups", Invariant.REFCOUNTS),
    Variant(hybrid.HitGroupsSwapped, "11 a hit's blocks given to the wrong KV-cache group", Invariant.CACHE_SOUNDNESS),
    Variant(hybrid.WindowInPoolBlocks, "11 a group's window found at the pool's block size", Invariant.CONTENT),
    Variant(hybrid.HitInPoolBlocks, "11 a hit ending inside a larger group's block", Invariant.CACHE_SOUNDNESS),
)


def variant(name: str) -> Variant:
    for candidate in VARIANTS:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no zoo variant named {name!r}; known: {', '.join(v.name for v in VARIANTS)}")
