"""Broken allocators: each is kvfuzz's correct allocator with one small, realistic slip of the kind real engines
shipped. Each docstring names the bug class (docs/invariants.md) and the real-world pattern the slip mirrors.

The variants exist to show kvfuzz at work and to prove, in the test suite, that every slip is caught and named by
the right invariant. Never use them for anything else.
"""

from __future__ import annotations

import attrs

from kvfuzz.allocator.block_pool import BlockPool
from kvfuzz.allocator.errors import OutOfBlocks
from kvfuzz.allocator.paged import PagedAllocator, _Sequence
from kvfuzz.allocator.prefix_cache import CacheEntry
from kvfuzz.allocator.types import NULL_BLOCK, AdmitResult, GrowResult, Namespace, SeqId, SwapResult, Tokens
from kvfuzz.engine.violations import Invariant
from kvfuzz.zoo.entry import Variant


class NoCopyOnWrite(PagedAllocator):
    """Class 10, copy-on-write missing: a forked sequence appends into the partial tail block it still shares with
    its sibling, as when a beam-search or parallel-sampling path forgets the copy for the last, partly filled block.
    """

    def _must_copy_before_write(self, tail: int) -> bool:
        return False


class CopiesWrongBlock(PagedAllocator):
    """Class 10, copy-on-write copying the wrong block: the copy order names the sequence's first block instead of
    its shared tail, an indexing slip in the code that builds the copy list.
    """

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        state = self._seqs.get(seq)
        first = state.table[0] if state is not None and state.table else None
        result = super().grow(seq, tokens)
        assert first is not None  # grow refused any sequence that is not running, and a running one has a table
        copies = tuple(type(copy)(src=first, dst=copy.dst) for copy in result.copies)
        return GrowResult(result.slots, copies)


class KeyWithoutNamespace(PagedAllocator):
    """Class 1, incomplete prefix-cache key: the block hash and its confirmation ignore the namespace, so a request
    under another LoRA adapter or cache salt is served K/V computed for different weights (vLLM and SGLang both
    shipped keys that missed the LoRA id or the multimodal content).
    """

    def _key_namespace(self, namespace: Namespace) -> Namespace:
        return ()


class KeyConcatenatesNamespace(PagedAllocator):
    """Class 1, ambiguous prefix-cache key: namespace parts are joined without a separator, so ("ab", "c") and
    ("a", "bc") share cached blocks, like a key built by string concatenation of adapter name and salt.
    """

    def _key_namespace(self, namespace: Namespace) -> Namespace:
        return ("".join(namespace),)


class MatchableAtAllocation(PagedAllocator):
    """Class 5, a block made matchable before its content is written: full blocks enter the prefix cache when they
    are allocated rather than when the step that fills them completes, so a request admitted meanwhile (or after the
    writer is cancelled before its first step) is told K/V is cached that no step has written.
    """

    def _schedule_registrations(self, state: _Sequence, first_index: int) -> None:
        size = self.block_size
        namespace = self._key_namespace(state.namespace)
        for index in range(first_index, len(state.hashes)):
            entry = CacheEntry(state.hashes[index], namespace, tuple(state.tokens[: (index + 1) * size]))
            self._cache.register(state.table[index], entry)


class FullHitCappedInPlace(PagedAllocator):
    """Class 9, full-prompt cache-hit edge case: when every block of a prompt is cached, the hit is capped one token
    short so the last token is recomputed (as engines do to get logits), but the last cached block is kept in the
    table instead of being copied, so the recomputed token is written into a block other requests share.
    """

    def _usable_hits(self, hits: list[int], num_tokens: int) -> list[int]:
        return hits

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        result = super().admit(seq, namespace, tokens)
        if result.num_cached_tokens and result.num_cached_tokens == len(tokens):
            self._seqs[seq].versions[-1] = next(self._version_clock)
            return AdmitResult(result.block_table, len(tokens) - 1)
        return result


class FreeForgetsSharedRefcount(PagedAllocator):
    """Class 4, refcount under-count on free: a finishing sequence skips the decrement for blocks it shares with a
    sibling, as in a free path that only handles exclusively owned blocks.
    """

    def _release_table(self, state: _Sequence) -> None:
        for block in reversed(state.table):
            if self._pool.refcount(block) == 1:
                self._pool.release(block)


class ReleasedTwiceOnPreempt(PagedAllocator):
    """Class 4, double free: preemption releases the blocks, then the generic free path it calls releases them
    again, as when two cleanup paths (abort and finish) both run for one request.
    """

    def preempt(self, seq: SeqId) -> None:
        state = self._running(seq, "preempt")
        for block in state.table[:1]:
            if self._pool.refcount(block) > 1:
                self._pool.release(block)
        super().preempt(seq)


class _ReleasesAtOnce(BlockPool):
    def release(self, block: int) -> None:
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            self._settle(block)


class ImmediateReuse(PagedAllocator):
    """Class 3, a block reused before in-flight work finished: the allocator declares one step of asynchronous
    scheduling (W = 1) but returns freed blocks to the free queue at once, as when a deferred-free list is bypassed.
    """

    pool_class = _ReleasesAtOnce


class _DropsDeferredFrees(BlockPool):
    def step_completed(self, step: int) -> None:
        self.last_completed_step = step
        if self._pending_order and self._pending_order[0][0] <= step:
            until, block = self._pending_order.popleft()
            if self._pending.get(block) == until:
                del self._pending[block]
                self._settle(block)
            while self._pending_order and self._pending_order[0][0] <= step:
                self._pending_order.popleft()


class DroppedDeferredFree(PagedAllocator):
    """Class 3 and 2, a deferred free that is dropped: when several blocks come due at one step completion only the
    first is returned; the rest stay pending forever (a loop that pops one entry per completed step).
    """

    pool_class = _DropsDeferredFrees


class LeakOnCancel(PagedAllocator):
    """Class 2, blocks leaked on abort: cancelling a request before its first step drops the references but never
    returns the blocks to the free queue (the cancel path skips the cleanup that the finish path runs).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._admitted_at: dict[SeqId, int] = {}

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        result = super().admit(seq, namespace, tokens)
        self._admitted_at[seq] = self._pool.last_completed_step
        return result

    def free(self, seq: SeqId) -> None:
        state = self._seqs.get(seq)
        if state is not None and self._admitted_at.get(seq) == self._pool.last_completed_step and state.table:
            del self._seqs[seq]
            state.live = False
            for block in state.table:
                self._pool._refcount[block] -= 1
            return
        super().free(seq)


class OpaqueLeakOnCancel(LeakOnCancel):
    """Class 2, the same leak in an allocator that exposes no introspection: only the quiescence probe can see it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.capabilities = attrs.evolve(self.capabilities, introspection=False)


class LeakyRefusal(PagedAllocator):
    """Class 6, accounting drift on refusal: a prompt's blocks are taken one at a time and the shortage is noticed
    half way, raising out-of-blocks without handing back what was already taken.
    """

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        needed = self._blocks_for(len(tokens))
        if seq not in self._seqs and tokens and needed > self._pool.num_available():
            self._pool.allocate(self._pool.num_available())
            raise OutOfBlocks(f"admit: {seq!r} needs {needed} blocks")
        return super().admit(seq, namespace, tokens)


class ReturnsNoneWhenFull(PagedAllocator):
    """Class 6, a refusal by return value: when the pool is short, ``grow`` returns None (vLLM's ``allocate_slots``
    convention) instead of raising out-of-blocks, so the engine's caller cannot tell a refusal it must check from
    a result it may use.
    """

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        try:
            return super().grow(seq, tokens)
        except OutOfBlocks:
            return None  # type: ignore[return-value]  # the slip: None where the contract raises


class FalseOutOfBlocks(PagedAllocator):
    """Class 6, a free counter that forgets evictable blocks: room is checked against never-used free blocks only,
    so a pool full of evictable cached blocks refuses requests it could serve.
    """

    def _check_room(self, fresh_needed: int, taken_from_evictable: int = 0) -> None:
        available = len(self._pool.free_blocks())
        if fresh_needed > available:
            raise OutOfBlocks(
                f"need {fresh_needed} block(s), {available} free", needed=fresh_needed, available=available
            )


class _SkipsEvictableTakes(BlockPool):
    """While ``skip_evictable`` is set, taking an evictable block takes no reference and leaves it evictable."""

    skip_evictable = False

    def take(self, block: int) -> None:
        if self.skip_evictable and block in self._evictable:
            return
        super().take(block)


class UnlockedPrefix(PagedAllocator):
    """Class 7, a matched prefix not locked: a cache hit maps evictable blocks into the new table without taking a
    reference, so they stay evictable and the next allocation under pressure hands them to someone else.
    """

    pool_class = _SkipsEvictableTakes
    _pool: _SkipsEvictableTakes

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        self._pool.skip_evictable = True
        try:
            return super().admit(seq, namespace, tokens)
        finally:
            self._pool.skip_evictable = False


class RollbackKeepsStaleBlock(PagedAllocator):
    """Class 8, rollback leaving stale state: rejected draft tokens are dropped from the token list but the blocks
    that held only them stay in the table (the rollback path trims tokens and forgets the table).
    """

    def rollback(self, seq: SeqId, num_tokens: int) -> None:
        state = self._running(seq, "rollback")
        table, versions = list(state.table), list(state.versions)
        super().rollback(seq, num_tokens)
        for block in table[len(state.table) :]:
            self._pool.take(block)
        state.table, state.versions = table, versions


class SwapInWrongHostBlock(PagedAllocator):
    """Swap-in that maps to the wrong host block: the host-to-device copy list is built from the host free order
    instead of the sequence's host table, so logical blocks come back permuted.
    """

    def swap_in(self, seq: SeqId) -> SwapResult:
        result = super().swap_in(seq)
        hosts = [host for host, _ in result.mapping]
        return SwapResult(zip(reversed(hosts), [device for _, device in result.mapping]))


class SilentDoubleFree(PagedAllocator):
    """Misuse accepted (invariant 11), double free accepted silently: freeing an unknown sequence is a no-op instead of
    an error, hiding the engine bug that called it (and any state the second call should not touch).
    """

    def free(self, seq: SeqId) -> None:
        if seq in self._seqs:
            super().free(seq)


class NonAtomicHostRefusal(PagedAllocator):
    """Class 6, a refusal that is not atomic: swap-out releases the device blocks before finding the host pool
    full, so the refused sequence loses its blocks.
    """

    def swap_out(self, seq: SeqId) -> SwapResult:
        state = self._running(seq, "swap_out")
        if len(state.table) > len(self._host_free):
            self._release_table(state)
            state.table = []
            raise OutOfBlocks(f"swap_out: {seq!r} does not fit in the host pool")
        return super().swap_out(seq)


class WindowDropIgnoresSharing(PagedAllocator):
    """Class 11, sliding-window dropping that ignores sharing: a block that slides out of one sequence's window is
    returned to the pool outright, though a forked sibling (or a prefix-cache hit) still references it, as when the
    window code calls the pool's free instead of dropping one reference.
    """

    def _drop_out_of_window(self, state: _Sequence) -> None:
        for index in range(self._first_kept_index(len(state.tokens))):
            block = state.table[index]
            if block != NULL_BLOCK:
                while self._pool.refcount(block) > 0:
                    self._pool.release(block)
                state.table[index] = NULL_BLOCK


class RepeatedBlockAfterRollback(PagedAllocator):
    """Class 4, a block repeated in a table and freed once per occurrence: after a rollback that ends on a block
    boundary, the next grow appends the sequence's last block again (a stale "last block" pointer the rollback did
    not reset), so the table holds one block twice while it is referenced once, and freeing the sequence releases
    it once per occurrence.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._stale_last: dict[SeqId, int] = {}

    def rollback(self, seq: SeqId, num_tokens: int) -> None:
        super().rollback(seq, num_tokens)
        state = self._seqs[seq]
        if len(state.tokens) % self.block_size == 0:
            self._stale_last[seq] = state.table[-1]

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        stale = self._stale_last.pop(seq, None)
        state = self._seqs.get(seq)
        if stale is not None and state is not None and tokens and stale in state.table:
            state.table.append(stale)
            state.versions.append(next(self._version_clock))
        return super().grow(seq, tokens)


VARIANTS: tuple[Variant, ...] = (
    Variant(
        KeyWithoutNamespace,
        "1 incomplete cache key",
        Invariant.CACHE_SOUNDNESS,
        cause="the prefixes differ only in their namespace",
    ),
    Variant(
        KeyConcatenatesNamespace,
        "1 ambiguous cache key",
        Invariant.CACHE_SOUNDNESS,
        cause="the prefixes differ only in their namespace",
    ),
    Variant(
        LeakOnCancel, "2 leak on cancel", Invariant.FREE_SET, cause="is in none of the free, cached and pending sets"
    ),
    Variant(OpaqueLeakOnCancel, "2 leak on cancel", Invariant.QUIESCENCE, cause="some blocks leaked"),
    Variant(
        ImmediateReuse,
        "3 reuse before in-flight work finished",
        Invariant.NON_REUSE_WINDOW,
        cause="for writing before its in-flight window closed",
    ),
    Variant(
        DroppedDeferredFree,
        "3 dropped deferred free",
        Invariant.FREE_SET,
        inflight_window=2,
        cause="is still pending though its window has closed",
    ),
    Variant(FreeForgetsSharedRefcount, "4 refcount under-count", Invariant.REFCOUNTS, cause="has refcount"),
    Variant(ReleasedTwiceOnPreempt, "4 double free", Invariant.REFCOUNTS, cause="has refcount"),
    Variant(
        MatchableAtAllocation,
        "5 matchable before written",
        Invariant.CACHE_SOUNDNESS,
        cause="no completed step has written",
    ),
    Variant(
        LeakyRefusal,
        "6 accounting drift",
        Invariant.ATOMIC_REFUSAL,
        cause="refused with OutOfBlocks, but the pool changed",
    ),
    Variant(
        FalseOutOfBlocks,
        "6 accounting drift",
        Invariant.NO_FALSE_REFUSAL,
        cause="refused for lack of blocks while the device pool could serve it",
    ),
    Variant(
        NonAtomicHostRefusal,
        "6 accounting drift",
        Invariant.ATOMIC_REFUSAL,
        cause="refused with OutOfBlocks, but the block table",
    ),
    Variant(UnlockedPrefix, "7 matched prefix not locked", Invariant.REFCOUNTS, cause="has refcount"),
    Variant(RollbackKeepsStaleBlock, "8 rollback leaves stale state", Invariant.REFCOUNTS, cause="block(s) for"),
    Variant(
        FullHitCappedInPlace,
        "9 full-prompt hit edge case",
        Invariant.EXCLUSIVE_WRITES,
        inflight_window=0,
        cause="while it is shared",
    ),
    Variant(NoCopyOnWrite, "10 copy-on-write missing", Invariant.EXCLUSIVE_WRITES, cause="(copy-on-write first)"),
    Variant(CopiesWrongBlock, "10 copy-on-write copies the wrong block", Invariant.CONTENT, cause="(copied from block"),
    Variant(
        SwapInWrongHostBlock,
        "swap-in maps the wrong host block",
        Invariant.CONTENT,
        cause="(swapped in from host block",
    ),
    Variant(SilentDoubleFree, "misuse accepted silently", Invariant.MISUSE, cause="was accepted silently"),
    Variant(
        WindowDropIgnoresSharing,
        "11 sliding window drops a shared block",
        Invariant.REFCOUNTS,
        sliding_window=9,
        cause="has refcount",
    ),
    Variant(
        RepeatedBlockAfterRollback,
        "4 repeated block freed per occurrence",
        Invariant.REFCOUNTS,
        cause="a block repeated in one table",
    ),
    Variant(ReturnsNoneWhenFull, "6 refusal returned, not raised", Invariant.RESULTS, cause="returned None"),
)
"""This module's slips, in the zoo's order, each with its bug class and the invariant that must catch it."""
