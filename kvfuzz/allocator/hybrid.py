"""kvfuzz's own allocator for a hybrid model: several KV-cache groups (full attention, sliding window) over one
shared block pool, with prefix caching under the hybrid hit rule.

Each sequence has one block table per group; every group draws fresh blocks from the one :class:`BlockPool`, and a
block sits in one group's tables only. The sliding-window group's blocks may hold more tokens than the pool's
``block_size`` (``sliding_block_size``, a multiple of it): group g's table holds ``ceil(len / size_g)`` blocks. A
full block becomes matchable for its group once the step that wrote it has completed, keyed by its group as well as
its namespace and prefix (the groups hold different layers' K/V). A hit of n tokens, n a multiple of every group's
block size (their lcm), is the longest for which the full-attention group matches every block before n and the
sliding-window group of window w matches the blocks covering positions [n - w + 1, n) (what the token after the
hit reads besides itself); a hit never covers a whole prompt. A sliding-window group drops (``NULL_BLOCK``) its
blocks before ``len - w`` as a sequence grows, and at admission maps no block wholly before its hit window. A
write into a partial tail block that another sequence shares, or that holds cached content, copies the block first.
Released blocks wait out the in-flight window W.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

import attrs

from kvfuzz.allocator.block_pool import BlockPool
from kvfuzz.allocator.errors import InvalidArgument, OutOfBlocks, SequenceExists, UnknownSequence
from kvfuzz.allocator.pooled import PooledAllocator
from kvfuzz.allocator.prefix_cache import CacheEntry, PrefixCache, chain_hash
from kvfuzz.allocator.types import (
    NULL_BLOCK,
    AdmitResult,
    BlockCopy,
    Capabilities,
    GrowResult,
    KVGroup,
    Namespace,
    PoolSpec,
    SeqId,
    Slot,
    Tokens,
    group_block_sizes,
)


@attrs.define(eq=False)
class _Sequence:
    """One live sequence: its namespace and tokens, and per group its block table and full blocks' chained hashes
    (``tables[g]`` and ``hashes[g]``, in ``kv_groups`` order)."""

    namespace: Namespace  # the request's namespace, as the engine gave it
    tokens: list[int]  # every token so far
    tables: list[list[int]]  # per group: the physical block of each logical block, NULL_BLOCK where dropped
    hashes: list[list[int]]  # per group: the chained hash of each full block
    live: bool = True  # False once freed or preempted: its pending registrations lapse


@attrs.frozen
class _Registration:
    """Make ``block`` matchable as ``entry`` once step ``commit_after`` has completed, if ``seq`` still maps it as
    its logical block ``index`` in group ``group``."""

    commit_after: int  # the step whose completion lands the block's writes
    seq: _Sequence  # the writer
    group: int  # the group whose table holds the block
    index: int  # its logical index there
    block: int  # the physical block
    entry: CacheEntry  # what it will hold

    def still_valid(self) -> bool:
        table = self.seq.tables[self.group]
        return self.seq.live and self.index < len(table) and table[self.index] == self.block


class HybridAllocator(PooledAllocator):
    """A refcounted, prefix-caching, copy-on-write allocator with one block table per KV-cache group: a
    full-attention group, then a sliding-window group of ``sliding_window`` tokens whose blocks hold
    ``sliding_block_size`` tokens (the pool's ``block_size`` when None), over one pool."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        num_host_blocks: int = 0,
        *,
        inflight_window: int = 0,
        prefix_caching: bool = True,
        sliding_window: Optional[int] = None,
        lookahead_blocks: int = 0,
        sliding_block_size: Optional[int] = None,
    ) -> None:
        if lookahead_blocks:
            raise ValueError("HybridAllocator: look-ahead blocks are not implemented")
        sliding_size = block_size if sliding_block_size is None else sliding_block_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = 0  # no swap, no host tier (as vLLM v1)
        # No rollback either: kvfuzz does not check rollback together with KV-cache groups yet.
        window = 2 * sliding_size + 1 if sliding_window is None else sliding_window
        self.capabilities = Capabilities(
            fork=True,
            prefix_cache=prefix_caching,
            namespaces=prefix_caching,
            eviction=True,
            targeted_eviction=prefix_caching,
            inflight_window=inflight_window,
            introspection=True,
            kv_groups=(
                KVGroup("full"),
                KVGroup("sliding", sliding_window=window, block_size=sliding_block_size),
            ),
        )
        self._groups = self.capabilities.kv_groups
        # Tokens one block holds in each group, and their lcm: every hit is a multiple of it.
        self._sizes = group_block_sizes(self._groups, block_size)
        self._hit_unit = math.lcm(*self._sizes)
        self._cache = PrefixCache()
        self._pool = BlockPool(
            num_blocks, inflight_window, is_cached=self._cache.is_cached, on_evict=self._cache.unregister
        )
        self._seqs: dict[SeqId, _Sequence] = {}
        self._registrations = deque()

    # -- the contract --------------------------------------------------------------------------------------------

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        tokens = tuple(tokens)
        if seq in self._seqs:
            raise SequenceExists(f"admit: sequence {seq!r} is already live")
        if not tokens:
            raise InvalidArgument(f"admit: sequence {seq!r} has no tokens")
        hashes = [self._full_block_hashes(group, namespace, tokens, []) for group in range(len(self._groups))]
        matched = [self._matches(group, namespace, tokens, hashes[group]) for group in range(len(self._groups))]
        hit = self._hit_tokens(matched, len(tokens))
        # Per group: the hit's cached block for each logical block from the group's first mapped one on, None where a
        # fresh block goes (every block from the hit on; inside the hit, none under the hybrid rule).
        plans = [
            [
                found.get(index) if index < hit // self._sizes[group] else None
                for index in range(self._first_hit_index(group, hit), self._blocks_for(group, len(tokens)))
            ]
            for group, found in enumerate(matched)
        ]
        taken = [block for plan in plans for block in plan if block is not None]
        evictable = self._pool.evictable_blocks()
        fresh_needed = sum(block is None for plan in plans for block in plan)
        self._check_room(fresh_needed, sum(block in evictable for block in taken))
        for block in taken:
            self._pool.take(block)
        fresh = iter(self._pool.allocate(fresh_needed))
        tables = [
            [NULL_BLOCK] * (self._blocks_for(group, len(tokens)) - len(plan))
            + [next(fresh) if block is None else block for block in plan]
            for group, plan in enumerate(plans)
        ]
        state = _Sequence(namespace, list(tokens), tables, hashes)
        self._seqs[seq] = state
        self._schedule_registrations(state, [hit // size for size in self._sizes])
        return AdmitResult(tuple(tables[0]), hit)

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        state = self._running(seq, "grow")
        if not tokens:
            raise InvalidArgument(f"grow: sequence {seq!r} given no tokens")
        old_len, new_len = len(state.tokens), len(state.tokens) + len(tokens)
        # Per group: (blocks dropped at once, fresh blocks, the partly filled tail block's index if it is copied).
        plans: list[tuple[int, int, Optional[int]]] = []
        for group, table in enumerate(state.tables):
            new_indices = range(len(table), self._blocks_for(group, new_len))
            dropped = sum(index < self._first_kept_index(group, new_len) for index in new_indices)
            tail_index = old_len // self._sizes[group]  # the partly filled block, when old_len is not aligned
            tail = table[tail_index] if old_len % self._sizes[group] else NULL_BLOCK
            copy_tail = tail != NULL_BLOCK and self._must_copy_before_write(tail)
            plans.append((dropped, len(new_indices) - dropped, tail_index if copy_tail else None))
        self._check_room(sum(fresh + (copied is not None) for _, fresh, copied in plans))
        copies = []
        for table, (dropped, fresh, copied) in zip(state.tables, plans):
            if copied is not None:
                (private,) = self._pool.allocate(1)
                copies.append(BlockCopy(src=table[copied], dst=private))
                self._pool.release(table[copied])
                table[copied] = private
            table.extend([NULL_BLOCK] * dropped + self._pool.allocate(fresh))
        first_new_full = [len(group_hashes) for group_hashes in state.hashes]
        state.tokens.extend(tokens)
        for group, group_hashes in enumerate(state.hashes):
            self._full_block_hashes(group, state.namespace, tuple(state.tokens), group_hashes)
        self._schedule_registrations(state, first_new_full)
        self._drop_out_of_window(state)
        size = self._sizes[0]
        slots = [Slot(state.tables[0][p // size], p % size) for p in range(old_len, new_len)]
        return GrowResult(slots, copies)

    def fork(self, parent: SeqId, child: SeqId) -> None:
        source = self._running(parent, "fork")
        if child in self._seqs:
            raise SequenceExists(f"fork: child {child!r} is already live")
        for table in source.tables:
            for block in table:
                if block != NULL_BLOCK:
                    self._pool.take(block)
        self._seqs[child] = _Sequence(
            source.namespace,
            list(source.tokens),
            [list(table) for table in source.tables],
            [list(group_hashes) for group_hashes in source.hashes],
        )

    def free(self, seq: SeqId) -> None:
        state = self._seqs.pop(seq, None)
        if state is None:
            raise UnknownSequence(f"free: sequence {seq!r} is not live (never admitted, or already freed)")
        state.live = False
        for table in state.tables:
            for block in reversed(table):  # tail first, so a table's tail blocks are evicted first
                if block != NULL_BLOCK:
                    self._pool.release(block)

    def preempt(self, seq: SeqId) -> None:
        self._running(seq, "preempt")
        self.free(seq)

    def block_table(self, seq: SeqId) -> tuple[int, ...]:
        return tuple(self._running(seq, "block_table").tables[0])

    def group_block_tables(self, seq: SeqId) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(table) for table in self._running(seq, "group_block_tables").tables)

    # -- helpers -------------------------------------------------------------------------------------------------

    def _key_namespace(self, group: int, namespace: Namespace) -> Namespace:
        """The namespace the prefix cache keys a group's block with: the group's name, then every part."""
        return (f"group:{self._groups[group].name}", *namespace)

    def _window(self, group: int) -> Optional[int]:
        return self._groups[group].sliding_window

    def _blocks_for(self, group: int, num_tokens: int) -> int:
        """How many blocks ``num_tokens`` tokens fill in ``group``."""
        return -(-num_tokens // self._sizes[group])

    def _first_kept_index(self, group: int, num_tokens: int) -> int:
        """A group's logical blocks before this one lie wholly before its window (0 for full attention)."""
        window = self._window(group)
        return 0 if window is None else max(0, num_tokens - window) // self._sizes[group]

    def _first_hit_index(self, group: int, hit_tokens: int) -> int:
        """The first logical block a hit of n = ``hit_tokens`` tokens needs in ``group``: 0 for full attention; for
        a sliding window of w, the block of position n - w + 1, the first the next token reads."""
        window = self._window(group)
        return 0 if window is None else max(0, hit_tokens - window + 1) // self._sizes[group]

    def _full_block_hashes(self, group: int, namespace: Namespace, tokens: Tokens, hashes: list[int]) -> list[int]:
        """Extend ``hashes`` with the chained hash, for ``group``, of every full block of ``tokens`` not yet hashed."""
        size, key = self._sizes[group], self._key_namespace(group, namespace)
        for index in range(len(hashes), len(tokens) // size):
            previous = hashes[index - 1] if index else None
            hashes.append(chain_hash(previous, key, tokens[index * size : (index + 1) * size]))
        return hashes

    def _matches(self, group: int, namespace: Namespace, tokens: Tokens, hashes: list[int]) -> dict[int, int]:
        """Logical index -> the cached block holding ``group``'s K/V of that full block of ``tokens``."""
        if not self.capabilities.prefix_cache:
            return {}
        key, size = self._key_namespace(group, namespace), self._sizes[group]
        found = {}
        for index, block_hash in enumerate(hashes):
            block = self._cache.lookup(block_hash, key, tokens[: (index + 1) * size])
            if block is not None:
                found[index] = block
        return found

    def _hit_tokens(self, matched: list[dict[int, int]], num_tokens: int) -> int:
        """The longest hit, in tokens, valid in every group (the hybrid rule): a multiple of every group's block
        size, short of the whole prompt (the engine needs the last token's query to sample from)."""
        unit = self._hit_unit
        for hit in range((num_tokens - 1) // unit * unit, 0, -unit):
            if all(
                all(index in found for index in range(self._first_hit_index(group, hit), hit // self._sizes[group]))
                for group, found in enumerate(matched)
            ):
                return hit
        return 0

    def _must_copy_before_write(self, tail: int) -> bool:
        """A partial tail is copied before a write if another sequence shares it or it holds cached content."""
        return self._pool.refcount(tail) > 1 or self._cache.is_cached(tail)

    def _running(self, seq: SeqId, op: str) -> _Sequence:
        state = self._seqs.get(seq)
        if state is None:
            raise UnknownSequence(f"{op}: sequence {seq!r} is not live (never admitted, freed, or preempted)")
        return state

    def _check_room(self, fresh_needed: int, taken_from_evictable: int = 0) -> None:
        available = self._pool.num_available() - taken_from_evictable
        if fresh_needed > available:
            raise OutOfBlocks(
                f"need {fresh_needed} fresh block(s), {available} available", needed=fresh_needed, available=available
            )

    def _schedule_registrations(self, state: _Sequence, first_indices: list[int]) -> None:
        """Every group's full blocks from its ``first_indices`` entry on become matchable after the step that writes
        them completes."""
        if not self.capabilities.prefix_cache:
            return
        commit_after = self._pool.last_completed_step + self._pool.inflight_window + 1
        for group, (table, group_hashes) in enumerate(zip(state.tables, state.hashes)):
            key, size = self._key_namespace(group, state.namespace), self._sizes[group]
            for index in range(first_indices[group], len(group_hashes)):
                if table[index] == NULL_BLOCK:
                    continue
                entry = CacheEntry(group_hashes[index], key, tuple(state.tokens[: (index + 1) * size]))
                self._registrations.append(_Registration(commit_after, state, group, index, table[index], entry))

    def _drop_out_of_window(self, state: _Sequence) -> None:
        """Each sliding-window group releases every block whose positions all lie before ``len - w``, the last
        dropped first."""
        for group, table in enumerate(state.tables):
            for index in reversed(range(self._first_kept_index(group, len(state.tokens)))):
                if table[index] != NULL_BLOCK:
                    self._pool.release(table[index])
                    table[index] = NULL_BLOCK


def hybrid_allocator(spec: PoolSpec) -> HybridAllocator:
    """kvfuzz's hybrid-model allocator: a full-attention group and a sliding-window group of two blocks and one
    token over one pool, prefix caching under the hybrid hit rule, and W = 1 (or the W the spec asks for)."""
    return HybridAllocator(
        spec.block_size, spec.num_blocks, inflight_window=1 if spec.inflight_window is None else spec.inflight_window
    )


def hybrid_allocator_sliding_double(spec: PoolSpec) -> HybridAllocator:
    """kvfuzz's hybrid-model allocator whose sliding-window group holds twice the pool's block size per block (its
    window two of those blocks and one token): groups of different block sizes over one pool, hits in multiples of
    the larger, W = 1 (or the W the spec asks for)."""
    return HybridAllocator(
        spec.block_size,
        spec.num_blocks,
        inflight_window=1 if spec.inflight_window is None else spec.inflight_window,
        sliding_block_size=2 * spec.block_size,
    )
