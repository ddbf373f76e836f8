"""Deep broken allocators: slips that a short run over the default pool rarely reaches.

Each is kvfuzz's correct allocator with one realistic slip whose trigger needs pool pressure, a long program, a
rollback or a swap at a particular moment, or a tiny pool; ``kvfuzz run``'s default budget of 100 examples over 16
blocks caught each in fewer than half of its seeds when it had no swarm. A campaign, and now ``kvfuzz run``'s
swarmed programs (long, in smaller pools), reach them (``python benchmarks/detection.py --default-run``). Each
docstring names the bug class (docs/invariants.md) and the real-world pattern the slip mirrors. Never use them for
anything else.
"""

from __future__ import annotations

from kvfuzz.allocator.block_pool import BlockPool
from kvfuzz.allocator.errors import OutOfBlocks
from kvfuzz.allocator.paged import PagedAllocator
from kvfuzz.allocator.prefix_cache import chain_hash
from kvfuzz.allocator.types import AdmitResult, Namespace, SeqId, SwapResult, Tokens
from kvfuzz.engine.violations import Invariant
from kvfuzz.zoo.entry import Variant


class _ForgetsEvictedEntries(BlockPool):
    """Evicting to make room inside ``allocate`` leaves the evicted block's cache entry behind; ``evict`` and
    ``reset_cache`` still unregister."""

    def allocate(self, count: int, reserve: int = 0) -> list[int]:
        on_evict, self._on_evict = self._on_evict, lambda block: None
        try:
            return super().allocate(count, reserve)
        finally:
            self._on_evict = on_evict


class StaleEntryAfterPressureEviction(PagedAllocator):
    """Class 1 and 5, a stale prefix-cache entry: when the free queue is empty and an allocation recycles the least
    recently used cached block, the block's hash entry is not removed, so a later request with the old prefix is
    "hit" on a block now holding another request's K/V. Only pool pressure reaches the recycling path (engines that
    evict from a separate code path than the explicit cache reset have shipped exactly this)."""

    pool_class = _ForgetsEvictedEntries


class SwapInTakesPendingBlocks(PagedAllocator):
    """Class 3, a block reused before in-flight work finished, through swap-in only: swap-in's capacity check and
    allocation count blocks whose deferred free has not happened yet, so when the free and cached queues cannot
    cover a swapped-out sequence, it is brought back into blocks the step still in flight may write (a swap-in
    path with its own free-block counter that includes blocks "about to be freed", unlike admission's)."""

    def swap_in(self, seq: SeqId) -> SwapResult:
        state = self._seqs.get(seq)
        pool = self._pool
        if state is None or state.host_table is None:
            return super().swap_in(seq)
        short = len(state.host_table) - pool.num_available()
        taken = list(pool._pending)[: max(0, short)]
        for block in taken:
            del pool._pending[block]
            pool._free[block] = None
        return super().swap_in(seq)


class CachedTailWrittenInPlace(PagedAllocator):
    """Class 8 and 10, rollback leaving a cached block writable: copy-on-write is decided by sharing alone, so after a
    rollback makes a full, cached block partial again, the next grow writes the new token into the cached block in
    place and the cache entry now describes content the block no longer holds (speculative decoding's rejected
    drafts combined with prefix caching, where the block's hash was computed before the rollback)."""

    def _must_copy_before_write(self, tail: int) -> bool:
        return self._pool.refcount(tail) > 1


class SwapInRefusalReleasesHost(PagedAllocator):
    """Class 6, a refusal that is not atomic for the host pool: swap-in hands the sequence's host blocks back to the
    host free list before it checks the device pool has room; when the device pool is short the sequence stays
    swapped out, but its host blocks are free and the next swap-out overwrites them (a swap-in path that frees the
    source before the copy is known to happen)."""

    def swap_in(self, seq: SeqId) -> SwapResult:
        state = self._seqs.get(seq)
        if state is not None and state.host_table is not None:
            for host_block in state.host_table:
                self._host_free[host_block] = None
        return super().swap_in(seq)


class AbortWhileSwappedLeaksHost(PagedAllocator):
    """Class 2, a host block leaked on abort: cancelling a request while it is swapped out returns all of its host
    blocks but the last (an off-by-one in the loop over the host table), so the host pool shrinks by a block per
    such abort and, once enough have leaked, swap-outs it could serve are refused (an abort path for the swapped
    queue that is exercised far less than the one for running requests)."""

    def free(self, seq: SeqId) -> None:
        state = self._seqs.get(seq)
        if state is not None and state.host_table:
            state.host_table = state.host_table[:-1]
        super().free(seq)


class WholePoolPromptRefused(PagedAllocator):
    """Class 6, an off-by-one in the "can never fit" check: a prompt that needs every block of the pool is refused as
    one that could never be served, as when the check compares the blocks needed with the pool's size using ``>=``
    (vLLM v0 refused such prompts outright, with a watermark, before it looked at free blocks). Only a pool as small
    as a prompt, or a sequence grown as large as the pool and readmitted, reaches it."""

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        needed = self._blocks_for(len(tokens))
        if seq not in self._seqs and needed >= self.num_blocks:
            raise OutOfBlocks(f"admit: {seq!r} needs {needed} blocks, the pool can never hold it")
        return super().admit(seq, namespace, tokens)


SHORT_HASH_BITS = 8
"""How many bits of each block hash :class:`TrustsShortBlockHash` keeps."""


class TrustsShortBlockHash(PagedAllocator):
    """Class 1, a prefix-cache key trusted without its content: blocks are keyed by a short hash of (previous hash,
    tokens) and a lookup that finds the hash takes the block without comparing the prefix, so two different prefixes
    whose hashes collide share K/V. A collision needs many distinct full blocks cached at once, that is a long
    program (vLLM keyed blocks by Python's ``hash()`` and trusted it until a collision advisory made it switch to
    SHA-256)."""

    def _full_block_hashes(self, namespace: Namespace, tokens: Tokens, hashes: list[int]) -> list[int]:
        size = self.block_size
        for index in range(len(hashes), len(tokens) // size):
            previous = hashes[index - 1] if index else None
            full = chain_hash(previous, namespace, tokens[index * size : (index + 1) * size])
            hashes.append(full & ((1 << SHORT_HASH_BITS) - 1))
        return hashes

    def _match(self, namespace: Namespace, tokens: Tokens, hashes: list[int]) -> list[int]:
        hits = []
        for block_hash in hashes:
            block = self._cache.first_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits


class RollbackKeepsPendingRegistration(PagedAllocator):
    """Class 5 and 8, a rollback that leaves a pending cache registration valid: a block filled by drafts is scheduled
    to become matchable once the step that writes it completes; when the drafts are rejected before that step runs,
    the rollback does not invalidate the registration, so the block becomes matchable for a prefix whose last tokens
    no step wrote (prefix caching that caches blocks by the number of scheduled tokens, rejected drafts included)."""

    def rollback(self, seq: SeqId, num_tokens: int) -> None:
        state = self._running(seq, "rollback")
        versions = list(state.versions)
        super().rollback(seq, num_tokens)
        state.versions[:] = versions[: len(state.versions)]


VARIANTS: tuple[Variant, ...] = (
    Variant(
        StaleEntryAfterPressureEviction,
        "1 stale cache entry after eviction under pressure",
        Invariant.CACHE_SOUNDNESS,
        deep=True,
    ),
    Variant(
        SwapInTakesPendingBlocks,
        "3 swap-in takes pending blocks",
        Invariant.NON_REUSE_WINDOW,
        deep=True,
        cause="for writing before its in-flight window closed",
    ),
    Variant(
        CachedTailWrittenInPlace,
        "8 rollback leaves a cached block writable",
        Invariant.CACHE_SOUNDNESS,
        deep=True,
        cause="the block was written in place past what its cache entry covered",
    ),
    Variant(
        SwapInRefusalReleasesHost,
        "6 refused swap-in frees its host blocks",
        Invariant.ATOMIC_REFUSAL,
        deep=True,
        cause="refused with OutOfBlocks, but the pool changed",
    ),
    Variant(
        AbortWhileSwappedLeaksHost,
        "2 host blocks leaked on abort",
        Invariant.FREE_SET,
        deep=True,
        cause="of a swapped-out sequence leaked it",
    ),
    Variant(
        WholePoolPromptRefused,
        "6 whole-pool prompt refused",
        Invariant.NO_FALSE_REFUSAL,
        deep=True,
        cause="refused for lack of blocks while the device pool could serve it",
    ),
    Variant(
        TrustsShortBlockHash, "1 short hash trusted", Invariant.CACHE_SOUNDNESS, deep=True, cause="a hash collision"
    ),
    Variant(
        RollbackKeepsPendingRegistration,
        "5 rollback keeps a pending registration",
        Invariant.CACHE_SOUNDNESS,
        deep=True,
        cause="but nothing has been written there",
    ),
)
"""This module's slips, in the zoo's order, each with its bug class and the invariant that must catch it."""
