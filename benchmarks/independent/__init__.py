"""Independent test subjects: a correct allocator and one-bug variants of it, written outside kvfuzz's own zoo.

Who wrote it and the rule
-------------------------

Written by a helper session (branch ``indep``) as an outside allocator author would, from the bug reports listed
in :data:`BUGS` and the allocator contract alone: README.md, docs/contract.md, docs/running.md, docs/invariants.md and
the contract's types in ``kvfuzz/allocator/``. Its author did not read how kvfuzz groups, explains or shrinks
failures (its signature, explanation, shrinking and campaign code, its zoo, its saved failures, nor their tests), so
the bugs are not shaped after what kvfuzz is known to report. A variant kvfuzz misses is a result, never a reason to
change the bug.

Contents
--------

* :mod:`.base`: :class:`~.base.LedgerAllocator`, a refcounted, prefix-caching, copy-on-write allocator with fork,
  swap, rollback, preemption, eviction (``evict``, ``reset_cache``, ``evict_blocks``) and introspection, in-flight
  window 0; ``kvfuzz run --allocator benchmarks.independent.base:factory`` passes.
* :mod:`.variants`: one class per bug report, each the base with that one bug; the class is the factory.
* :data:`BUGS`: every variant with its report, in report order.
* ``python -m benchmarks.independent.detect``: runs ``kvfuzz run`` on every variant over a few seeds and prints
  what caught each and how fast.

What kvfuzz caught
------------------

``python -m benchmarks.independent.detect --seeds 5`` (default ``kvfuzz run``: 100 examples of up to 50 steps,
seeds 1 to 5): every variant but two is caught under every seed, most within 20 examples and a third of a second.
The two deep ones: ``CopyOnWriteForForksOnly`` (1 of 5 seeds; it needs a rollback into a block taken from a cache hit
while that block is still shared or cached, then a grow) and ``RollbackKeepsPartialDigest`` (4 of 5). Both are
caught with ``--examples 1000`` under each of seeds 1 to 6 (``CopyOnWriteForForksOnly`` after 32 to 829 examples,
``RollbackKeepsPartialDigest`` after 6 to 126), which is the budget ``tests/test_independent.py`` gives every variant.
"""

from __future__ import annotations

from typing import Callable

import attrs

from kvfuzz.allocator import PoolSpec

from . import variants as v


@attrs.frozen
class Bug:
    """One independent test subject: ``factory(spec)`` builds the allocator with the bug ``report`` describes."""

    name: str
    report: str
    factory: Callable[[PoolSpec], object]

    @property
    def spec(self) -> str:
        """How ``kvfuzz run --allocator`` names the factory."""
        return f"benchmarks.independent.variants:{self.name}"


def _bug(cls: type[v.LedgerAllocator], report: str) -> Bug:
    return Bug(cls.__name__, report, cls)


BUGS: tuple[Bug, ...] = (
    _bug(
        v.ForkedFreeReleasesTwice,
        "A block's reference count is released once too often when a forked sequence is freed.",
    ),
    _bug(
        v.CopyOnWriteForForksOnly,
        "Copy-on-write is skipped when the shared last block came from a prefix-cache hit rather than a fork.",
    ),
    _bug(
        v.FloorGrowth,
        "Growing a sequence computes the blocks needed with floor division instead of ceiling (one block short exactly"
        " when the new length is not a multiple of the block size).",
    ),
    _bug(
        v.EvictChecksNeighbourRefcount,
        "Eviction picks a cached block that a running sequence still holds (checks the wrong block's ref count).",
    ),
    _bug(
        v.PreemptKeepsScheduledDigest,
        "Preempting (recompute) a sequence frees its blocks but leaves the hash of its partially filled last block in"
        " the prefix cache.",
    ),
    _bug(
        v.SwapInReversed, "Swap-in maps the host blocks back in reverse order for sequences with more than two blocks."
    ),
    _bug(
        v.RollbackKeepsTable,
        "Rolling back speculative tokens frees the trailing blocks but leaves the block table pointing at them.",
    ),
    _bug(v.CancelUngrownLeaks, "Cancelling a request that was admitted but never grown leaks its blocks."),
    _bug(
        v.DigestWithoutParent, "The prefix-cache key of a block hashes only that block's tokens, not its parent's key."
    ),
    _bug(v.ForkAliasesTable, "Fork gives the child the same table list object as the parent (aliasing)."),
    _bug(
        v.AdmitRefusalKeepsTaken,
        "A refused admission (not enough free blocks) has already taken some blocks out of the free list when it"
        " refuses.",
    ),
    _bug(
        v.HitStaysEvictable,
        "A prefix-cache hit on an evictable block does not remove it from the evictable list, so it can be handed out"
        " again.",
    ),
    _bug(v.LastHitUncounted, "A prefix-cache hit does not increment the reference count of the last block of the hit."),
    _bug(
        v.SwapOutZeroesShared,
        "Swap-out of a sequence whose blocks are shared with a forked sibling releases the shared blocks to zero.",
    ),
    _bug(v.RollbackBoundaryOneShort, "Rollback that ends exactly on a block boundary frees one block too many."),
    _bug(
        v.ReleaseIgnoresCache,
        "Freeing a sequence puts its blocks on the free list even when they are still registered in the prefix cache,"
        " and the cache entry survives reuse of the block.",
    ),
    _bug(
        v.CopyOnWriteWrongWay,
        "The prefix cache keeps a full block's entry after the block was rewritten by a copy-on-write that went the"
        " wrong way (the writer kept the original block and the reader got the copy, but the cache still names the"
        " original).",
    ),
    _bug(
        v.CapacityCountsCachedTwice,
        "The capacity check counts cached-but-free blocks twice (once as free, once as evictable), so admission"
        " succeeds and then allocation fails midway.",
    ),
    _bug(
        v.RepeatedFreeRequeues, "A repeated free of a finished sequence puts its blocks on the free list a second time."
    ),
    _bug(v.FreeCountOffByOne, "The free blocks reported for introspection leave one block out (off by one)."),
    _bug(v.EvictReportsRequested, "Eviction reports the number of blocks asked for, not the number it dropped."),
    _bug(v.WholePromptHit, "A prompt of whole blocks can be a prefix-cache hit in full, leaving no token to compute."),
    _bug(v.NamespaceBlindDigest, "The prefix-cache key leaves out the namespace (LoRA adapter, cache salt)."),
    _bug(v.SwappedFreeLeaksHost, "Freeing a swapped-out sequence does not return its host blocks."),
    _bug(
        v.RegisterWhenScheduled,
        "Full blocks are registered in the prefix cache when their writes are scheduled, before a step has written"
        " them.",
    ),
    _bug(
        v.RollbackKeepsPartialDigest,
        "Rollback keeps the hash of the block it made partial, so the refilled block and its successors are cached"
        " under the old prefix.",
    ),
    _bug(
        v.GrowIgnoresEvictable, "Growth counts only free blocks as room, refusing while evictable blocks would serve."
    ),
)
"""Every independent variant, in the order of its report (1 to 18 from the brief, 19 on added here)."""

__all__ = ["BUGS", "Bug"]
