"""SGLang's RadixCache over a PagedTokenToKVPoolAllocator and a ReqToTokenPool, driven as SGLang's scheduler does.

Geometry. SGLang's paged allocator hands out pages ``1 .. num_pages``: page 0 (token slots ``0 .. page_size - 1``) is
the padding page that padded batches write into. The pool is built with ``num_blocks * page_size`` tokens, so it
has exactly ``num_blocks`` allocatable pages, and kvfuzz's block ``b`` is SGLang's page ``b + 1``. A sequence's block
table is read off its ``req_to_token`` row: logical block ``i`` is ``row[i * page_size] // page_size - 1``, and the
slot of position ``p`` is ``(row[p] // page_size - 1, row[p] % page_size)``, both exactly as SGLang stores them.

Lifecycle, mirroring the scheduler (``schedule_policy.PrefillAdder``, ``mem_cache.allocation``,
``batch_result_processor``, ``schedule_batch.release_req``):

* admit: ``Req.init_next_round_input`` matches the prompt in the tree (page-aligned, capped one token short of the
  prompt as SGLang always is), the prefill budget is checked against free plus evictable pages, the matched node is
  locked, a ``req_to_token`` row is taken, and ``alloc_paged_token_slots_extend`` evicts from the tree under pressure
  and allocates the rest, which is written into the row.
* grow: one token on a fully computed sequence is a decode step (``alloc_paged_token_slots_decode``); anything else
  extends the row like a chunked-prefill continuation (``alloc_paged_token_slots_extend`` from the row's last slot).
* after a step: a sequence that ran an extend (a prefill or a chunk) is checkpointed into the tree
  (``checkpoint_kv_cache``), as ``process_batch_result`` does; decode steps are not.
* free: a sequence whose every token was computed finishes (``release_kv_cache(checkpoint=True)``: its KV is
  inserted into the tree, duplicate pages freed, the lock dropped); one with tokens no step has computed is aborted
  (``release_kv_cache(checkpoint=False)``), since SGLang never inserts KV that no forward pass wrote.
* preempt: SGLang's retraction (``release_req``): release without inserting, then evict for the remaining running
  requests, then ``Req.reset_for_retract``; the next admit of the same id matches again, as a retracted request does.

SGLang's checkpoint may find the pages it inserts already in the tree (another request computed the same prefix
meanwhile), free its own copies and repoint the request's row at the tree's pages, so a running request's block table
changes when its step completes: declared as ``remaps_on_step``, which makes kvfuzz re-read the tables then and check
every moved position bit for bit.

Namespaces become the request fields that key the tree: ``radix_cache`` sets ``extra_key`` and ``cache_salt``
(``RadixKey`` keeps the two apart); ``radix_cache_lora`` sets ``extra_key`` and ``lora_id``, which ``Req.__init__``
concatenates into one string (SGLang issue #24638: a key collision kvfuzz finds, kept in ``corpus/``).

Introspection is read off SGLang's state: free blocks from the allocator's free pages, cached blocks from the pages
of tree nodes no request locks (what ``RadixCache.evict`` may drop), refcounts from the live requests' rows. W = 0:
the synchronous scheduler (no overlap), which frees at once.

Eviction: ``evict(n)`` is ``RadixCache.evict`` asked for ``n`` pages' worth of tokens; it drops whole unlocked
leaves, least recently used first, until at least that many tokens are gone or nothing unlocked is left, so it may
drop more than ``n`` blocks: declared as ``evict_rounds_up``. ``reset_cache`` is the same call asked for every
evictable token (``RadixCache.reset()`` is safe only on an idle engine, ``flush_cache``). SGLang also evicts inside
admission and decode allocation, as driven here.

Not declared: fork, swap (HiRadixCache is out of scope), rollback (speculative decoding is out of scope). The
admission budget is free plus evictable pages; the PrefillAdder's reservation for running requests' future decode
tokens is scheduling policy, not modelled.
"""

from __future__ import annotations

import enum
from array import array
from typing import Any, Collection

import attrs
import torch

from kvfuzz.adapters.base import SequenceLedger
from kvfuzz.adapters.sglang._engine import in_context, sglang
from kvfuzz.allocator.errors import InvalidArgument, OutOfBlocks
from kvfuzz.allocator.types import (
    AdmitResult,
    Capabilities,
    GrowResult,
    Namespace,
    PoolSpec,
    SeqId,
    Slot,
    Tokens,
)

CODE_UNDER_TEST = ("sglang", ("srt/mem_cache",))
"""What a campaign's --coverage measures of this adapter's allocator: SGLang's token pools, allocators and radix caches
(kvfuzz.coverage.scope)."""

MAX_NEW_TOKENS = 1 << 30
"""A request's generation budget: kvfuzz, not a length limit, decides when a sequence finishes."""


class _Phase(enum.Enum):
    RUNNING = "running"
    RETRACTED = "retracted"


@attrs.define(eq=False)
class _Request:
    """One kvfuzz sequence and the SGLang ``Req`` that carries it.

    ``length`` tokens are allocated in the row (``req.kv.kv_committed_len`` while running); ``computed`` of them
    were written by a completed step. ``extended`` says the request ran an extend since the last step.
    """

    req: Any  # SGLang's Req, which kvfuzz type-checks without (SGLang is an optional engine)
    length: int
    phase: _Phase = _Phase.RUNNING
    computed: int = 0
    extended: bool = True


SALTED = ("extra_key", "cache_salt")
"""Namespace parts as ``Req(extra_key=..., cache_salt=...)``: RadixKey keys the tree by the pair, kept apart."""

LORA = ("extra_key", "lora_id")
"""Namespace parts as ``Req(extra_key=..., lora_id=...)``: ``Req.__init__`` keys the tree by their concatenation."""


def _key_fields(namespace: Namespace, fields: tuple[str, ...]) -> dict[str, str]:
    """The ``Req`` keyword arguments a namespace sets: its parts, in order, as ``fields``."""
    if len(namespace) > len(fields):
        raise InvalidArgument(
            f"namespace {namespace!r} has {len(namespace)} parts; this adapter maps at most "
            f"{len(fields)} ({', '.join(fields)})"
        )
    return dict(zip(fields, namespace))


class SGLangRadixAllocator:
    """kvfuzz's contract over SGLang's RadixCache, PagedTokenToKVPoolAllocator and ReqToTokenPool."""

    def __init__(self, spec: PoolSpec, *, namespaces: bool = True, key_fields: tuple[str, ...] = SALTED) -> None:
        if spec.block_size < 2:
            raise ValueError(
                f"block size {spec.block_size}: SGLang serves page size 1 with TokenToKVPoolAllocator, "
                "not the paged allocator this adapter drives"
            )
        self.block_size, self.num_blocks, self.num_host_blocks = spec.block_size, spec.num_blocks, 0
        # RadixCache shares KV only through the tree, not between live requests (no fork); its host tier is
        # HiRadixCache's cache (hicache.py), not swap; speculative decoding is out of scope (no rollback).
        self.capabilities = Capabilities(
            prefix_cache=True,
            namespaces=namespaces,
            eviction=True,
            evict_rounds_up=True,
            introspection=True,
            remaps_on_step=True,
        )
        self.key_fields = key_fields
        self._build(spec)
        self.sequences = SequenceLedger()  # the requests held and their phases; raises the misuse errors
        self._requests: dict[SeqId, _Request] = {}  # running or retracted request -> its Req and progress

    @in_context
    def _build(self, spec: PoolSpec) -> None:
        engine = sglang()
        page = spec.block_size
        self.token_pool = engine.PagedTokenToKVPoolAllocator(
            spec.num_blocks * page, page_size=page, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False
        )
        # Every running request holds at least one page of its own, so num_blocks rows always suffice.
        self.req_to_token_pool = engine.ReqToTokenPool(
            size=spec.num_blocks, max_context_len=(spec.num_blocks + 1) * page, device="cpu", enable_memory_saver=False
        )
        self.tree = engine.RadixCache(
            engine.CacheInitParams(
                disable=False,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.token_pool,
                page_size=page,
            )
        )

    # -- the contract --------------------------------------------------------------------------------------------

    @in_context
    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        self.sequences.check_admit(seq, tokens)
        state = self._requests.get(seq)
        if state is None:
            engine = sglang()
            req = engine.Req(
                seq,
                "",
                array("q", tokens),
                engine.SamplingParams(max_new_tokens=MAX_NEW_TOKENS),
                **_key_fields(namespace, self.key_fields),
            )
        else:
            req = state.req
            if tuple(req.origin_input_ids) + tuple(req.output_ids) != tuple(tokens):
                raise InvalidArgument(f"admit: retracted sequence {seq!r} comes back with other tokens")
        prefix_len = self._admit_req(seq, req, len(tokens))
        self._requests[seq] = _Request(req, len(tokens), computed=prefix_len)
        self.sequences.admitted(seq)
        return AdmitResult(self._table(self._requests[seq]), prefix_len)

    @in_context
    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        state = self._running(seq, "grow")
        self.sequences.check_tokens("grow", seq, tokens)
        old_len, new_len = state.length, state.length + len(tokens)
        self._check_room(self._pages(new_len) - self._pages(old_len), f"grow {seq!r} by {len(tokens)}")
        req = state.req
        req.output_ids.extend(tokens)
        req.refresh_fill_ids()
        if len(tokens) == 1 and state.computed == old_len:
            self._alloc_decode(req, old_len)
        else:
            self._alloc_extend(req, old_len, new_len)
            state.extended = True
        state.length = new_len
        row = self._row(req)
        page = self.block_size
        return GrowResult([Slot(int(row[p]) // page - 1, int(row[p]) % page) for p in range(old_len, new_len)])

    @in_context
    def free(self, seq: SeqId) -> None:
        self.sequences.live(seq, "free")
        state = self._requests.pop(seq)
        engine, req = sglang(), state.req
        if state.computed == state.length:
            req.finished_reason = engine.FINISH_LENGTH(length=len(req.output_ids))
            engine.release_kv_cache(req, self.tree, checkpoint=True)
        else:
            req.finished_reason = engine.FINISH_ABORT()
            engine.release_kv_cache(req, self.tree, checkpoint=False)
        self.sequences.freed(seq)

    @in_context
    def preempt(self, seq: SeqId) -> None:
        state = self._running(seq, "preempt")
        engine = sglang()
        engine.release_kv_cache(state.req, self.tree, checkpoint=False)
        still_running = sum(other.phase is _Phase.RUNNING for other in self._requests.values()) - 1
        engine.evict_from_tree_cache(self.tree, still_running * engine.retract_decode_steps())
        state.req.reset_for_retract()
        state.phase, state.computed, state.extended = _Phase.RETRACTED, 0, False
        self.sequences.preempted(seq)

    @in_context
    def step_completed(self, step: int) -> None:
        """``process_batch_result``: every running request's tokens are computed; those that ran an extend are
        checkpointed into the tree."""
        for state in self._requests.values():
            if state.phase is _Phase.RUNNING:
                state.computed = state.length
                if state.extended:
                    self._checkpoint(state)
                    state.extended = False

    def library_block_name(self, block: int) -> str:
        """Block ``block`` as SGLang numbers its pages (past its padding page 0), for ``kvfuzz show``."""
        return f"SGLang page {block + 1}"

    def block_table(self, seq: SeqId) -> tuple[int, ...]:
        return self._table(self._running(seq, "block_table"))

    @in_context
    def evict(self, num_blocks: int) -> int:
        if num_blocks < 0:
            raise InvalidArgument(f"evict: cannot evict {num_blocks} blocks")
        result = self.tree.evict(sglang().EvictParams(num_tokens=num_blocks * self.block_size))
        return int(result.num_tokens_evicted) // self.block_size

    @in_context
    def reset_cache(self) -> None:
        self.tree.evict(sglang().EvictParams(num_tokens=self.tree.evictable_size()))

    # -- introspection -------------------------------------------------------------------------------------------

    def refcount(self, block: int) -> int:
        # Read afresh at every question: a count cached across calls could go stale and report (or hide) a leak.
        return sum(
            self._table(state).count(block) for state in self._requests.values() if state.phase is _Phase.RUNNING
        )

    def free_blocks(self) -> Collection[int]:
        return [page - 1 for page in self.token_pool.get_all_free_pages().tolist()]

    def cached_blocks(self) -> Collection[int]:
        """Pages of tree nodes no request locks: what ``RadixCache.evict`` may drop."""
        page = self.block_size
        blocks: list[int] = []
        stack = list(self.tree.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.lock_ref == 0:
                blocks.extend(slot // page - 1 for slot in node.value[::page].tolist())  # tolist() gives ints
        return blocks

    def pending_blocks(self) -> Collection[int]:
        return ()

    # -- the scheduler's steps -----------------------------------------------------------------------------------

    def _admit_req(self, seq: SeqId, req: Any, length: int) -> int:
        """Match, lock, check the prefill budget, extend the match, take a row and allocate the prompt; return the
        cached length."""
        engine = sglang()
        req.init_next_round_input(self.tree)
        lock = self.tree.lock(req.last_node)
        try:
            self._check_room(self._pages(length) - req.prefix_len // self.block_size, f"admit {seq!r}")
        except OutOfBlocks:
            self.tree.unlock(lock)
            req.prefix_len, req.last_node, req.kv.cache_protected_len = 0, None, 0
            raise
        lock = self._extend_match(req, lock)
        prefix_len = req.prefix_len
        req.lock, req.extend_end = lock, length
        engine.alloc_req_slots(self.req_to_token_pool, [req], self.tree)
        prefix = self.tree.prefix_device_indices(req)
        self._row(req)[:prefix_len] = prefix.to(torch.int32)
        self._alloc_extend(req, prefix_len, length)
        return prefix_len

    def _extend_match(self, req: Any, lock: Any) -> Any:
        """Once the budget admits the request, what may lengthen its match past the device (a host tier's load-back);
        ``lock`` pins the match, and the lock returned pins the request's match from then on. Here: nothing."""
        return lock

    def _alloc_extend(self, req: Any, prefix_len: int, seq_len: int) -> None:
        """``alloc_for_extend`` for one request whose row holds ``prefix_len`` slots: evict, allocate, write."""
        row = self._row(req)
        last_loc = row[prefix_len - 1 : prefix_len].to(torch.int64) if prefix_len else torch.tensor([-1])
        prefix_lens, seq_lens = torch.tensor([prefix_len]), torch.tensor([seq_len])
        out = sglang().alloc_paged_token_slots_extend(
            tree_cache=self.tree,
            prefix_lens=prefix_lens,
            prefix_lens_cpu=prefix_lens,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens,
            last_loc=last_loc,
            extend_num_tokens=seq_len - prefix_len,
        )
        row[prefix_len:seq_len] = out.to(torch.int32)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = seq_len

    def _alloc_decode(self, req: Any, seq_len: int) -> None:
        """``alloc_for_decode`` for one request: one slot at position ``seq_len``."""
        row = self._row(req)
        seq_lens = torch.tensor([seq_len + 1])
        out = sglang().alloc_paged_token_slots_decode(
            tree_cache=self.tree,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens,
            last_loc=row[seq_len - 1 : seq_len].to(torch.int64),
        )
        row[seq_len] = int(out[0])
        req.kv.kv_allocated_len += 1
        req.kv.kv_committed_len += 1

    def _checkpoint(self, state: _Request) -> None:
        """What ``process_batch_result`` does for a request after its extend ran: insert it into the tree."""
        state.req.extend_end = state.length
        sglang().checkpoint_kv_cache(state.req, self.tree)

    def _check_room(self, pages_needed: int, what: str) -> None:
        """The scheduler's budget: free pages plus pages the tree could evict (nodes no request locks)."""
        page = self.block_size
        available = self.token_pool.available_size() // page + self.tree.evictable_size() // page
        if pages_needed > available:
            raise OutOfBlocks(
                f"{what}: needs {pages_needed} new page(s), {available} free or evictable",
                needed=pages_needed,
                available=available,
            )

    # -- helpers -------------------------------------------------------------------------------------------------

    def _running(self, seq: SeqId, op: str) -> _Request:
        """The running request (``sequences`` raises for any other)."""
        self.sequences.running(seq, op)
        return self._requests[seq]

    def _row(self, req: Any) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]

    def _pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _table(self, state: _Request) -> tuple[int, ...]:
        """The request's block table, read off the first slot of each of its pages in its row (one indexing of the
        ``req_to_token`` tensor: refcount reads every running request's table)."""
        page = self.block_size
        firsts = self.req_to_token_pool.req_to_token[state.req.kv.req_pool_idx, 0 : state.length : page].tolist()
        return tuple(slot // page - 1 for slot in firsts)


def radix_cache(spec: PoolSpec) -> SGLangRadixAllocator:
    """SGLang's RadixCache (page size = block size) over a paged token pool of exactly ``spec.num_blocks`` pages;
    namespaces map to ``extra_key`` and ``cache_salt``."""
    return SGLangRadixAllocator(spec)


def radix_cache_one_namespace(spec: PoolSpec) -> SGLangRadixAllocator:
    """The same, with every request in the empty namespace (no extra_key, no cache_salt)."""
    return SGLangRadixAllocator(spec, namespaces=False)


def radix_cache_lora(spec: PoolSpec) -> SGLangRadixAllocator:
    """The same, with namespaces as a request's ``extra_key`` and LoRA adapter id (``lora_id``)."""
    return SGLangRadixAllocator(spec, key_fields=LORA)
