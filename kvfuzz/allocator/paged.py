"""kvfuzz's own paged allocator: the correct behaviour every other allocator is measured against.

Per sequence it keeps the tokens, the block table and the chained hash of every full block. Full blocks become
matchable in the prefix cache only once the step that wrote them has completed, and a hit never covers a whole
prompt (its last token is always computed). A write into a partial tail block
that another sequence also references, or that holds cached content (a full cached block made partial by a
rollback), copies the block first (copy-on-write): cached content is never modified in place, so a cache entry stays
true for as long as it exists. Released blocks wait out the in-flight window W.

With a look-ahead of K blocks (``lookahead_blocks``), admit and grow give every sequence K blocks beyond the ones its
tokens fill, as an engine reserves slots for a drafter's K/V; a rollback keeps up to K blocks of the dropped tokens
as look-ahead, but only blocks it owns alone and that hold no cached content, so a look-ahead block is never shared
nor matchable. A fork shares only the blocks holding tokens.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Collection, Optional

import attrs

from kvfuzz.allocator.block_pool import BlockPool
from kvfuzz.allocator.errors import InvalidArgument, OutOfBlocks, SequenceExists, UnknownSequence, Unsupported
from kvfuzz.allocator.pooled import PooledAllocator
from kvfuzz.allocator.prefix_cache import CacheEntry, PrefixCache, chain_hash
from kvfuzz.allocator.types import (
    NULL_BLOCK,
    AdmitResult,
    BlockCopy,
    Capabilities,
    EvictionOrder,
    GrowResult,
    Namespace,
    PoolSpec,
    SeqId,
    Slot,
    SwapResult,
    Tokens,
)


@attrs.define(eq=False)
class _Sequence:
    """One live sequence. ``table`` is empty while swapped out; then ``host_table`` holds its K/V.

    ``versions[i]`` changes whenever logical block i may receive different content, so a registration scheduled
    for an older version is known to be stale.
    """

    namespace: Namespace
    tokens: list[int]
    table: list[int]
    hashes: list[int]
    versions: list[int]
    host_table: Optional[list[int]] = None
    live: bool = True


@attrs.frozen
class _Registration:
    """Make ``block`` matchable once step ``commit_after`` has completed, if it still holds ``version``."""

    commit_after: int
    seq: _Sequence
    index: int
    block: int
    version: int
    entry: CacheEntry

    def still_valid(self) -> bool:
        seq = self.seq
        return (
            seq.live
            and self.index < len(seq.table)
            and seq.table[self.index] == self.block
            and seq.versions[self.index] == self.version
        )


class PagedAllocator(PooledAllocator):
    """A refcounted, prefix-caching, copy-on-write paged allocator with swap, rollback and an in-flight window."""

    pool_class = BlockPool
    cache_class = PrefixCache

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        num_host_blocks: int = 0,
        *,
        inflight_window: int = 0,
        prefix_caching: bool = True,
        reserved_blocks: int = 0,
        sliding_window: Optional[int] = None,
        lookahead_blocks: int = 0,
    ) -> None:
        if lookahead_blocks and sliding_window is not None:
            raise ValueError("PagedAllocator: look-ahead blocks with a sliding window are not implemented")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks if sliding_window is None else 0
        self.capabilities = Capabilities(
            fork=True,
            prefix_cache=prefix_caching,
            namespaces=prefix_caching,
            swap=self.num_host_blocks > 0,
            rollback=True,
            eviction=True,
            targeted_eviction=prefix_caching,
            eviction_order=EvictionOrder.LRU if prefix_caching else None,
            complete_caching=prefix_caching and sliding_window is None,
            inflight_window=inflight_window,
            reserved_blocks=reserved_blocks,
            sliding_window=sliding_window,
            introspection=True,
            lookahead_blocks=lookahead_blocks,
        )
        self._lookahead = lookahead_blocks  # blocks given beyond those a sequence's tokens fill
        self._cache = self.cache_class()
        self._pool = self.pool_class(
            num_blocks, inflight_window, is_cached=self._cache.is_cached, on_evict=self._cache.unregister
        )
        self._host_free: dict[int, None] = dict.fromkeys(range(num_host_blocks))
        self._seqs: dict[SeqId, _Sequence] = {}
        self._registrations = deque()
        self._version_clock = itertools.count()

    # -- the contract --------------------------------------------------------------------------------------------

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        tokens = tuple(tokens)
        if seq in self._seqs:
            raise SequenceExists(f"admit: sequence {seq!r} is already live")
        if not tokens:
            raise InvalidArgument(f"admit: sequence {seq!r} has no tokens")
        hashes = self._full_block_hashes(self._key_namespace(namespace), tokens, [])
        hits = self._usable_hits(self._match(self._key_namespace(namespace), tokens, hashes), len(tokens))
        skipped = self._first_kept_index(len(tokens))
        kept_hits = hits[skipped:]
        reach = self._reach(len(tokens))
        fresh_needed = reach - max(skipped, len(hits))
        evictable = self._pool.evictable_blocks()
        self._check_room(fresh_needed, taken_from_evictable=sum(block in evictable for block in kept_hits))
        for block in kept_hits:
            self._pool.take(block)
        fresh = iter(self._pool.allocate(fresh_needed))
        table = [
            NULL_BLOCK if index < skipped else hits[index] if index < len(hits) else next(fresh)
            for index in range(reach)
        ]
        state = _Sequence(namespace, list(tokens), table, hashes, [next(self._version_clock) for _ in table])
        self._seqs[seq] = state
        self._schedule_registrations(state, first_index=len(hits))
        self._drop_out_of_window(state)
        return AdmitResult(tuple(state.table), len(hits) * self.block_size)

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        state = self._running(seq, "grow")
        if not tokens:
            raise InvalidArgument(f"grow: sequence {seq!r} given no tokens")
        old_len, new_len = len(state.tokens), len(state.tokens) + len(tokens)
        new_indices = range(len(state.table), self._reach(new_len))
        dropped_at_once = sum(index < self._first_kept_index(new_len) for index in new_indices)
        new_blocks = len(new_indices) - dropped_at_once
        writes_into_tail = old_len % self.block_size != 0
        tail_index = old_len // self.block_size  # the partly filled block, when writes_into_tail
        tail = state.table[tail_index] if writes_into_tail else NULL_BLOCK
        copy_tail = writes_into_tail and self._must_copy_before_write(tail)
        self._check_room(new_blocks + copy_tail)
        copies = []
        if copy_tail:
            (private,) = self._pool.allocate(1)
            copies.append(BlockCopy(src=tail, dst=private))
            self._pool.release(tail)
            state.table[tail_index] = private
        # The partial tail and any kept look-ahead block the new tokens reach receive new content.
        for index in range(old_len // self.block_size, min(len(state.table), self._blocks_for(new_len))):
            state.versions[index] = next(self._version_clock)
        state.table.extend([NULL_BLOCK] * dropped_at_once + self._pool.allocate(new_blocks))
        state.versions.extend(next(self._version_clock) for _ in new_indices)
        first_new_full = len(state.hashes)
        state.tokens.extend(tokens)
        self._full_block_hashes(self._key_namespace(state.namespace), tuple(state.tokens), state.hashes)
        self._schedule_registrations(state, first_index=first_new_full)
        self._drop_out_of_window(state)
        block_size = self.block_size
        slots = [Slot(state.table[p // block_size], p % block_size) for p in range(old_len, new_len)]
        return GrowResult(slots, copies)

    def fork(self, parent: SeqId, child: SeqId) -> None:
        source = self._running(parent, "fork")
        if child in self._seqs:
            raise SequenceExists(f"fork: child {child!r} is already live")
        filled = self._blocks_for(len(source.tokens))  # look-ahead blocks stay the parent's own
        for block in source.table[:filled]:
            if block != NULL_BLOCK:
                self._pool.take(block)
        self._seqs[child] = _Sequence(
            source.namespace,
            list(source.tokens),
            source.table[:filled],
            list(source.hashes),
            source.versions[:filled],
        )

    def free(self, seq: SeqId) -> None:
        state = self._seqs.pop(seq, None)
        if state is None:
            raise UnknownSequence(f"free: sequence {seq!r} is not live (never admitted, or already freed)")
        state.live = False
        self._release_table(state)
        for host_block in state.host_table or ():
            self._host_free[host_block] = None

    def preempt(self, seq: SeqId) -> None:
        self._running(seq, "preempt")
        self.free(seq)

    def swap_out(self, seq: SeqId) -> SwapResult:
        state = self._running(seq, "swap_out")
        if not self.capabilities.swap:
            raise Unsupported("swap_out: this allocator has no host pool")
        if len(state.table) > len(self._host_free):
            raise OutOfBlocks(
                f"swap_out: {seq!r} needs {len(state.table)} host block(s), {len(self._host_free)} free",
                needed=len(state.table),
                available=len(self._host_free),
            )
        host = list(itertools.islice(self._host_free, len(state.table)))
        for host_block in host:
            del self._host_free[host_block]
        mapping = list(zip(state.table, host))
        self._release_table(state)
        state.table, state.versions, state.host_table = [], [], host
        return SwapResult(mapping)

    def swap_in(self, seq: SeqId) -> SwapResult:
        state = self._seqs.get(seq)
        if state is None or state.host_table is None:
            raise InvalidArgument(f"swap_in: sequence {seq!r} is not swapped out")
        self._check_room(len(state.host_table))
        device = self._pool.allocate(len(state.host_table))
        mapping = list(zip(state.host_table, device))
        for host_block in state.host_table:
            self._host_free[host_block] = None
        state.table, state.host_table = device, None
        state.versions = [next(self._version_clock) for _ in device]
        self._schedule_registrations(state, first_index=0)
        return SwapResult(mapping)

    def rollback(self, seq: SeqId, num_tokens: int) -> None:
        state = self._running(seq, "rollback")
        if not 1 <= num_tokens < len(state.tokens):
            raise InvalidArgument(
                f"rollback: {seq!r} holds {len(state.tokens)} tokens, cannot drop {num_tokens} (must keep at least one)"
            )
        new_len = len(state.tokens) - num_tokens
        sliding_window = self.capabilities.sliding_window
        if (
            sliding_window is not None
            and NULL_BLOCK in state.table[max(0, new_len - sliding_window) // self.block_size :]
        ):
            raise InvalidArgument(
                f"rollback: dropping {num_tokens} tokens of {seq!r} would bring blocks already "
                f"dropped by the sliding window back into it"
            )
        keep = filled = self._blocks_for(new_len)
        while (
            keep < min(len(state.table), filled + self._lookahead)
            and self._pool.refcount(state.table[keep]) == 1
            and not self._cache.is_cached(state.table[keep])
        ):
            keep += 1  # kept as look-ahead: owned alone, holding no cached content
        for block in reversed(state.table[keep:]):
            self._pool.release(block)
        del (
            state.table[keep:],
            state.versions[keep:],
            state.tokens[new_len:],
            state.hashes[new_len // self.block_size :],
        )
        # The partial tail and the kept look-ahead blocks will receive other content (no registration still due).
        for index in range(new_len // self.block_size, keep):
            state.versions[index] = next(self._version_clock)

    def block_table(self, seq: SeqId) -> tuple[int, ...]:
        return tuple(self._running(seq, "block_table").table)

    # -- introspection (the pool's, in PooledAllocator) ----------------------------------------------------------

    def host_free_blocks(self) -> Collection[int]:
        return self._host_free.keys()

    # -- helpers -------------------------------------------------------------------------------------------------

    def _key_namespace(self, namespace: Namespace) -> Namespace:
        """The namespace as the prefix cache keys it: every part, boundaries kept."""
        return namespace

    def _must_copy_before_write(self, tail: int) -> bool:
        """A partial tail is copied before a write if another sequence shares it or it holds cached content."""
        return self._pool.refcount(tail) > 1 or self._cache.is_cached(tail)

    def _commit_step(self) -> int:
        """Blocks filled by work scheduled now are written by a step that has completed once this step has."""
        return self._pool.last_completed_step + self._pool.inflight_window + 1

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _reach(self, num_tokens: int) -> int:
        """The blocks a sequence of ``num_tokens`` tokens is given: those its tokens fill, and the look-ahead."""
        return self._blocks_for(num_tokens) + self._lookahead

    def _running(self, seq: SeqId, op: str) -> _Sequence:
        state = self._seqs.get(seq)
        if state is None:
            raise UnknownSequence(f"{op}: sequence {seq!r} is not live (never admitted, freed, or preempted)")
        if state.host_table is not None:
            raise InvalidArgument(f"{op}: sequence {seq!r} is swapped out")
        return state

    def _check_room(self, fresh_needed: int, taken_from_evictable: int = 0) -> None:
        reserve = self.capabilities.reserved_blocks
        available = self._pool.num_available() - taken_from_evictable
        if fresh_needed + reserve > available:
            raise OutOfBlocks(
                f"need {fresh_needed} fresh block(s) (+{reserve} reserved), {available} available",
                needed=fresh_needed,
                available=available,
            )

    def _full_block_hashes(self, namespace: Namespace, tokens: Tokens, hashes: list[int]) -> list[int]:
        """Extend ``hashes`` with the chained hash of every full block of ``tokens`` not yet hashed."""
        size = self.block_size
        for index in range(len(hashes), len(tokens) // size):
            previous = hashes[index - 1] if index else None
            hashes.append(chain_hash(previous, namespace, tokens[index * size : (index + 1) * size]))
        return hashes

    def _match(self, namespace: Namespace, tokens: Tokens, hashes: list[int]) -> list[int]:
        if not self.capabilities.prefix_cache:
            return []
        hits = []
        for index, block_hash in enumerate(hashes):
            block = self._cache.lookup(block_hash, namespace, tokens[: (index + 1) * self.block_size])
            if block is None:
                break
            hits.append(block)
        return hits

    def _usable_hits(self, hits: list[int], num_tokens: int) -> list[int]:
        """A hit never covers the whole prompt: the engine needs the last token's query to sample from, so a prompt
        whose every block is cached gives up its last block's hit and recomputes that block into a fresh one (as
        vLLM caps a hit at ``len - 1`` tokens); the cached block itself is never rewritten."""
        return hits[:-1] if hits and len(hits) * self.block_size == num_tokens else hits

    def _schedule_registrations(self, state: _Sequence, first_index: int) -> None:
        """Full blocks from ``first_index`` on become matchable after the step that writes them completes."""
        if not self.capabilities.prefix_cache:
            return
        commit_after = self._commit_step()
        size = self.block_size
        namespace = self._key_namespace(state.namespace)
        for index in range(first_index, len(state.hashes)):
            if state.table[index] == NULL_BLOCK:
                continue
            entry = CacheEntry(state.hashes[index], namespace, tuple(state.tokens[: (index + 1) * size]))
            self._registrations.append(
                _Registration(commit_after, state, index, state.table[index], state.versions[index], entry)
            )

    def _release_table(self, state: _Sequence) -> None:
        """Drop the sequence's device references, tail first, so its tail blocks are evicted first."""
        for block in reversed(state.table):
            if block != NULL_BLOCK:
                self._pool.release(block)

    def _first_kept_index(self, num_tokens: int) -> int:
        """Logical blocks before this one lie wholly outside the sliding window (0 without a window)."""
        sliding_window = self.capabilities.sliding_window
        return 0 if sliding_window is None else max(0, num_tokens - sliding_window) // self.block_size

    def _drop_out_of_window(self, state: _Sequence) -> None:
        """With a sliding window w, release every block whose positions all lie before ``len - w``; blocks that
        would be dropped at once are never allocated at all. The last dropped block is released first, as a free
        releases a table's tail first."""
        for index in reversed(range(self._first_kept_index(len(state.tokens)))):
            if state.table[index] != NULL_BLOCK:
                self._pool.release(state.table[index])
                state.table[index] = NULL_BLOCK


def _window(spec: PoolSpec, default: int) -> int:
    """The W a factory of kvfuzz's allocator builds: the one asked for, else the factory's ``default``."""
    return default if spec.inflight_window is None else spec.inflight_window


def paged_allocator(spec: PoolSpec) -> PagedAllocator:
    """kvfuzz's default allocator: prefix caching, swap, and one step of asynchronous scheduling in flight (W = 1,
    or the W the spec asks for)."""
    return PagedAllocator(spec.block_size, spec.num_blocks, spec.num_host_blocks, inflight_window=_window(spec, 1))


def sliding_window_allocator(spec: PoolSpec) -> PagedAllocator:
    """The default allocator with a sliding window of three blocks: older blocks are dropped as sequences grow."""
    return PagedAllocator(
        spec.block_size, spec.num_blocks, inflight_window=_window(spec, 1), sliding_window=3 * spec.block_size
    )


def lookahead_allocator(spec: PoolSpec) -> PagedAllocator:
    """The default allocator with two look-ahead blocks per sequence, kept through rollbacks (speculative decoding
    with a drafter that writes ahead of the tokens)."""
    return PagedAllocator(
        spec.block_size, spec.num_blocks, spec.num_host_blocks, inflight_window=_window(spec, 1), lookahead_blocks=2
    )


def synchronous_allocator(spec: PoolSpec) -> PagedAllocator:
    """The same allocator with a synchronous engine (W = 0): released blocks are reusable at once."""
    return PagedAllocator(spec.block_size, spec.num_blocks, spec.num_host_blocks, inflight_window=0)


def unshared_allocator(spec: PoolSpec) -> PagedAllocator:
    """The default allocator with its prefix cache off: paging without prefix sharing (forks still share)."""
    return PagedAllocator(
        spec.block_size, spec.num_blocks, spec.num_host_blocks, inflight_window=_window(spec, 1), prefix_caching=False
    )
