"""transformers' continuous-batching ``PagedAttentionCache`` behind the kvfuzz contract.

The shim plays the part of transformers' ``ContinuousBatchProcessor`` and its scheduler (synchronous batching, no
safety margin), calling the cache exactly where they do:

* admit: a new request is scheduled whole. Like ``Scheduler._infer_request_tokens``, a pending request first looks
  for a prefix match (``search_prefix_match``, which acquires the matched blocks and never covers the whole prompt);
  then ``can_store_request_tokens`` allocates the rest.
* grow: the request's next tokens (a decode token or a chunk) are scheduled with ``can_store_request_tokens``.
* Scheduling records ``count_new_complete_blocks`` for the request, and advances its ``position_offset`` as
  ``prepare_batch_tensors`` does. When kvfuzz reports the step completed, ``mark_complete_blocks`` hashes those
  blocks, as ``update_batch`` does after the forward: this is when blocks become matchable, and when a block
  duplicating an already-hashed one is swapped for it (de-duplication).
* Under memory pressure the engine evicts every cached block at once (``evict_cached_blocks``, the first thing
  ``OffloadingManager.offload_requests`` does) and schedules again. The shim evicts only when that lets the request
  fit; otherwise it refuses, where the engine would go on to offload other requests (kvfuzz preempts by itself).
  A fork that does not fit gets the same treatment (the engine would requeue the child as a new request, which
  gets its room by the same eviction).
* free: ``Scheduler.finish_request`` / cancellation, i.e. ``free_blocks(request_id)``: complete blocks stay cached.
* preempt: a soft reset (``offload_requests`` without a CPU pool): ``free_blocks(request_id, no_cache=True)``; the
  request comes back later as a new pending request with all its tokens.
* evict(n), reset_cache: ``evict_cached_blocks`` drops every cached block; ``evict(n)`` calls it when that is at
  most n blocks and drops none otherwise (the library has no partial eviction).

A refused admission cancels the request (``free_blocks``), which hands back any prefix blocks its match acquired.

Where the library and kvfuzz's contract differ (not worked around here):

* De-duplication changes a running request's block table when a step completes; kvfuzz's harness expects a table to
  change only in an operation on that sequence, so with block sharing the machine reports the first duplicate block.
* A fork copies the parent's partial last block into a fresh block at once, where kvfuzz's fork shares every block:
  fork is not declared, and ``fork`` returns those copies for a caller that drives it directly.
* Not supported at all: swap (CPU offloading needs a pinned host pool, hence an accelerator, and its scheduler picks
  the victims), rollback (no speculative decoding), namespaces (no cache salt or adapter in the block hash).

Block ids: transformers numbers blocks from the start of its cache tensor, whose first two sectors are trash sectors
that are never allocated; kvfuzz block ``b`` is transformers block ``b + offset``.
"""

from __future__ import annotations

from typing import Any, Collection, Sequence

import attrs

from kvfuzz.adapters.base import SequenceLedger
from kvfuzz.allocator.errors import InvalidArgument, OutOfBlocks, Unsupported
from kvfuzz.allocator.types import (
    AdmitResult,
    BlockCopy,
    Capabilities,
    GrowResult,
    Namespace,
    SeqId,
    Slot,
    Tokens,
)

_GROUP = "full_attention"


@attrs.define(eq=False)
class _Scheduled:
    """Work scheduled for the next step: once it completes, ``complete_blocks`` of ``state`` get hashed."""

    state: Any
    complete_blocks: dict[str, int]


class TransformersPagedCache:
    """A transformers ``PagedAttentionCache`` (one full-attention group) driven as its batch processor drives it.

    ``_states`` holds the ``RequestState`` of every running request (``sequences``); ``_scheduled`` the requests
    scheduled since the last completed step, in scheduling order, whose complete blocks are marked when that step
    completes.
    """

    def __init__(self, cache: Any) -> None:
        from transformers.generation.continuous_batching.requests import RequestState, RequestStatus

        self._request_state, self._status = RequestState, RequestStatus
        self.cache = cache
        self.allocator = cache.cache_allocators[_GROUP]
        self.ledger = self.allocator.ledger
        self.block_size = self.allocator.tokens_per_page
        self.num_blocks = self.allocator.num_blocks
        self.num_host_blocks = 0
        self._per_sector = self.allocator.blocks_per_sector
        self._offset = cache.pool.num_reserved_sectors * self._per_sector
        sharing = cache.use_prefix_sharing
        # With sharing, mark_complete_blocks swaps a duplicate block for the cached one when a step completes.
        # Without it, fork copies every block of the parent: kvfuzz cannot size that refusal, so it is not driven.
        # Never swap (transformers' CPU offloading needs a pinned host pool and its scheduler) nor rollback (its
        # continuous batching has no speculative decoding): neither method exists.
        self.capabilities = Capabilities(
            fork=sharing,
            fork_copies=sharing,
            prefix_cache=sharing,
            eviction=sharing,
            introspection=True,
            remaps_on_step=sharing,
        )
        self.sequences = SequenceLedger()  # the requests held and their phases; raises the misuse errors
        self._states: dict[SeqId, Any] = {}
        self._scheduled: list[_Scheduled] = []
        self._last_completed = -1

    # -- the contract --------------------------------------------------------------------------------------------

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        self.sequences.check_admit(seq, tokens)
        if namespace:
            raise Unsupported(f"admit: transformers has no cache namespaces; got {namespace!r} for {seq!r}")
        state = self._request_state(request_id=seq, initial_tokens=list(tokens), max_new_tokens=None)
        cached = 0
        if self.cache.use_prefix_sharing:
            cached = self.cache.search_prefix_match(seq, state.remaining_prefill_tokens)
            state.remaining_prefill_tokens = state.remaining_prefill_tokens[cached:]
            state.position_offset += cached
        request_tokens = state.remaining_prefill_tokens
        try:
            self._store(state, len(request_tokens), f"admit of {seq!r}")
        except OutOfBlocks:
            self.cache.free_blocks(seq)
            raise
        state.remaining_prefill_tokens = []
        self._states[seq] = state
        self.sequences.admitted(seq)
        self._schedule(state, request_tokens)
        return AdmitResult(self.block_table(seq), cached)

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        state = self._live(seq, "grow")
        self.sequences.check_tokens("grow", seq, tokens)
        old_len = state.current_len()
        self._store(state, len(tokens), f"grow of {seq!r} by {len(tokens)} token(s)")
        state.generated_tokens.extend(tokens)
        self._schedule(state, list(tokens))
        table = self.block_table(seq)
        size = self.block_size
        return GrowResult([Slot(table[p // size], p % size) for p in range(old_len, state.current_len())])

    def fork(self, parent: SeqId, child: SeqId) -> tuple[BlockCopy, ...]:
        """transformers' fork (parallel sampling): complete blocks are shared, the partial last block is copied into a
        fresh block at once. Returns the copies the engine performs."""
        self.sequences.check_fork(parent, child)
        state = self._states[parent]
        copies: dict[str, tuple[list[int], list[int]]] = {_GROUP: ([], [])}
        self.cache.pool.try_to_free_sectors()
        if not self.cache.prepare_fork_request(state, [child], copies):
            needed = self.allocator.count_non_shareable_blocks(parent, state.current_len())
            self._evict_if_it_makes_room(needed, f"fork of {parent!r}")
            if not self.cache.prepare_fork_request(state, [child], copies):
                raise OutOfBlocks(f"fork of {parent!r}: no room for the copy of its partial block after eviction")
        self._states[child] = state.fork(child)
        self.sequences.admitted(child)
        sources, destinations = copies[_GROUP]
        return tuple(BlockCopy(self._ours(src), self._ours(dst)) for src, dst in zip(sources, destinations))

    def free(self, seq: SeqId) -> None:
        self._forget(seq, "free")
        self.cache.free_blocks(seq)
        self.sequences.freed(seq)

    def preempt(self, seq: SeqId) -> None:
        self._forget(seq, "preempt")
        self.cache.free_blocks(seq, no_cache=True)
        self.sequences.preempted(seq)

    def evict(self, num_blocks: int) -> int:
        if num_blocks < 0:
            raise InvalidArgument(f"evict: cannot evict {num_blocks} blocks")
        cached = len(self.ledger.cached_blocks)
        if cached > num_blocks:
            return 0
        self.reset_cache()
        return cached

    def reset_cache(self) -> None:
        self.cache.evict_cached_blocks()

    def step_completed(self, step: int) -> None:
        if step <= self._last_completed:
            raise InvalidArgument(f"step_completed({step}) after step {self._last_completed} completed")
        self._last_completed = step
        scheduled, self._scheduled = self._scheduled, []
        for work in scheduled:
            self.cache.mark_complete_blocks(work.state, work.complete_blocks)

    def library_block_name(self, block: int) -> str:
        """Block ``block`` as transformers numbers it (past its trash sectors), for ``kvfuzz show``."""
        return f"transformers block {block + self._offset}"

    def block_table(self, seq: SeqId) -> tuple[int, ...]:
        self._live(seq, "block_table")
        return tuple(self._ours(block) for block in self.allocator.block_table.get(seq, ()))

    # -- introspection, from the block ledger and the cache pool -------------------------------------------------

    def refcount(self, block: int) -> int:
        """The ledger keeps counts of 2 or more; a block in no ledger structure is owned by one request, or free."""
        theirs = block + self._offset
        count = self.ledger.shared_ref_counts.get(theirs)
        if count is not None:
            return count
        return 0 if theirs in self.ledger.cached_blocks or block in self.free_blocks() else 1

    def free_blocks(self) -> Collection[int]:
        """Free blocks of the group's partly used sectors, then every block of each free sector."""
        pool, per_sector = self.cache.pool, self._per_sector
        leaves = [leaf for tree in pool._free_blocks[self.allocator.index].trees.values() for leaf in tree]
        leaves += [sector * per_sector + i for sector in pool.free_sectors for i in range(per_sector)]
        return [self._ours(leaf) for leaf in leaves]

    def cached_blocks(self) -> Collection[int]:
        return [self._ours(block) for block in self.ledger.cached_blocks]

    def pending_blocks(self) -> Collection[int]:
        return ()

    # -- helpers -------------------------------------------------------------------------------------------------

    def _ours(self, block: int) -> int:
        return block - self._offset

    def _live(self, seq: SeqId, op: str) -> Any:
        """The running request's state (``sequences`` raises for any other)."""
        self.sequences.running(seq, op)
        return self._states[seq]

    def _forget(self, seq: SeqId, op: str) -> None:
        """The request leaves: its scheduled work that has not run is dropped with it."""
        state = self._live(seq, op)
        del self._states[seq]
        self._scheduled = [work for work in self._scheduled if work.state is not state]

    def _store(self, state: Any, num_tokens: int, what: str) -> None:
        """Allocate for ``num_tokens`` more tokens, after handing empty sectors back to the pool as each scheduling pass
        does; under pressure, evict every cached block first if that makes room."""
        self.cache.pool.try_to_free_sectors()
        if self.cache.can_store_request_tokens(state, num_tokens):
            return
        self._evict_if_it_makes_room(
            self.allocator.needs_new_blocks(state.request_id, state.current_len(), num_tokens), what
        )
        if not self.cache.can_store_request_tokens(state, num_tokens):
            raise OutOfBlocks(f"{what}: no room after evicting every cached block")

    def _evict_if_it_makes_room(self, needed: int, what: str) -> None:
        """Evict every cached block (then hand empty sectors back) if that leaves ``needed`` free blocks; otherwise
        refuse, changing nothing."""
        pool = self.cache.pool
        available = pool.count_free_blocks(self.allocator.index) + pool.num_free_sectors * self._per_sector
        cached = len(self.ledger.cached_blocks)
        if not cached or needed > available + cached:
            raise OutOfBlocks(
                f"{what}: needs {needed} new block(s), {available} free and {cached} cached",
                needed=needed,
                available=available + cached,
            )
        self.reset_cache()
        pool.try_to_free_sectors()

    def _schedule(self, state: Any, tokens: Sequence[int]) -> None:
        """The request is in the next batch with ``tokens``: count the blocks it will complete, advance its offset."""
        state.tokens_to_process = list(tokens)
        state.status = self._status.DECODING
        complete = self.cache.count_new_complete_blocks(state, len(tokens))
        state.position_offset += len(tokens)
        if complete:
            self._scheduled.append(_Scheduled(state, complete))
