"""vLLM v0's block manager (``vllm.core.block_manager.SelfAttnBlockSpaceManager``) behind the kvfuzz contract.

The adapter is a scheduler shim: it calls the block manager exactly where vLLM 0.10.2's v0 ``Scheduler`` and
``LLMEngine`` do, with real ``Sequence`` and ``SequenceGroup`` objects, and never corrects what the block manager
decides. Each kvfuzz sequence is one ``Sequence`` in a ``SequenceGroup`` of its own (a forked child gets its own group
too, since kvfuzz frees, preempts and swaps every branch on its own).

* ``admit``: ``get_num_cached_tokens`` (as ``Scheduler._get_num_new_uncached_and_cached_tokens`` does, including
  its rule that a fully cached prompt recomputes its last token), ``can_allocate`` then ``allocate``. ``LATER`` or
  ``NEVER`` is an :class:`OutOfBlocks`, after ``remove_seq_from_computed_blocks_tracker`` as the scheduler does.
* ``grow``: ``can_append_slots`` then ``append_slots``; the copy-on-write pairs it returns become ``BlockCopy``.
  The scheduler asks ``can_append_slots`` once the sampled tokens are on the sequence; the adapter asks before
  appending them, passing their count as lookahead slots, which the block manager counts identically, so that a
  refusal leaves the ``Sequence`` untouched.
* ``preempt``: ``Scheduler._preempt_by_recompute``; ``swap_out`` / ``swap_in``: ``can_swap_out`` / ``can_swap_in``
  then the swap, whose (source, destination) mapping is returned as is.
* ``step_completed``: the end of ``Scheduler.schedule`` for the batch that just ran (block tables read,
  ``access_all_blocks_in_seq``, ``get_common_computed_block_ids``, then ``mark_blocks_as_computed``), followed by
  the engine's ``update_num_computed_tokens``. The v0 block manager assumes a synchronous engine: W = 0.

Namespaces map to LoRA adapters (the block hash's ``extra_hash`` is the LoRA id): each distinct namespace gets its
own ``lora_int_id``, the empty one none. There is no rollback (v0 speculative decoding uses lookahead slots that
never enter the block table) and no eviction call (only ``reset_prefix_cache``, which refuses while any block is in
use). The watermark is the engine default (1% of the device blocks, rounded down), declared as ``reserved_blocks``.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path
from typing import Any, Collection, Optional

import attrs

from kvfuzz.adapters.base import SequenceLedger
from kvfuzz.adapters.vllm_v0_constants import ENGINE_WATERMARK, NO_EXTRA_HASH, PINNED_NONE_HASH
from kvfuzz.allocator.errors import InvalidArgument, OutOfBlocks, Unsupported
from kvfuzz.allocator.types import (
    AdmitResult,
    BlockCopy,
    Capabilities,
    GrowResult,
    Namespace,
    PoolSpec,
    SeqId,
    Slot,
    SwapResult,
    Tokens,
)

CODE_UNDER_TEST = ("vllm", ("core/block", "core/block_manager.py"))
"""What a campaign's --coverage measures of this adapter's allocator: vLLM V0's block space manager and its block
allocators (kvfuzz.coverage.scope)."""


def _has_v0_block_manager() -> bool:
    """Whether the installed vLLM still ships ``vllm/core/block_manager.py`` (found without importing vLLM)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and any(
        (Path(location) / "core" / "block_manager.py").is_file() for location in spec.submodule_search_locations or ()
    )


if not _has_v0_block_manager():
    # Fail at import, so that a trace naming this adapter is skipped where vLLM's v0 block manager is not installed.
    raise ImportError(
        "kvfuzz.adapters.vllm_v0 needs vllm 0.10.2 (its v0 block manager); build an environment with "
        "scripts/third_party_env.sh vllm-v0"
    )


def _pin_block_hashes() -> None:
    """Make v0's block hashes the same in every process, so that a program replays the same way in a fresh one.

    vLLM's hashes are otherwise drawn per process: the chain starts from ``hash('None')`` (randomized per interpreter)
    and a block without a LoRA adapter hashes ``None`` into its key (an address in Python 3.11). Which blocks the
    evictor and the computed-blocks tracker meet first then differs between processes, and a bug reached through
    them fails one way in one process and another way (or not at all) in the next: a finding that cannot be saved.
    Pinning both to constants changes no decision vLLM makes in one process, only which arbitrary values it hashes.
    """
    from vllm.core.block import prefix_caching_block as module

    if getattr(module, "_kvfuzz_pinned", False):
        return
    for holder in (module.PrefixCachingBlockAllocator, module.PrefixCachingBlock, module.ComputedBlocksTracker):
        holder._none_hash = PINNED_NONE_HASH
    hash_block_tokens = module.PrefixCachingBlock.hash_block_tokens.__func__

    def pinned(
        cls: type,
        is_first_block: bool,
        prev_block_hash: Optional[int],
        cur_block_token_ids: Any,
        extra_hash: Any = None,
    ) -> int:
        extra = NO_EXTRA_HASH if extra_hash is None else extra_hash
        return int(hash_block_tokens(cls, is_first_block, prev_block_hash, cur_block_token_ids, extra))

    module.PrefixCachingBlock.hash_block_tokens = classmethod(pinned)  # type: ignore[method-assign,assignment]
    module._kvfuzz_pinned = True  # type: ignore[attr-defined]


@attrs.define(eq=False)
class _Request:
    """One kvfuzz sequence: its vLLM ``Sequence``, the ``SequenceGroup`` holding it alone, and its namespace.

    The ``Sequence``'s status is the scheduler's view (RUNNING, SWAPPED, or WAITING after a preemption).
    """

    seq: Any
    group: Any
    namespace: Namespace

    @property
    def tokens(self) -> Tokens:
        return tuple(self.seq.get_token_ids())


class VllmV0BlockManager:
    """A ``SelfAttnBlockSpaceManager`` driven the way vLLM v0's scheduler drives it."""

    def __init__(
        self, spec: PoolSpec, *, enable_caching: bool, fork: bool = True, preempt_scheduled: bool = False
    ) -> None:
        from vllm.core.block_manager import SelfAttnBlockSpaceManager
        from vllm.utils import Device

        _pin_block_hashes()

        self.block_size = spec.block_size
        self.num_blocks = spec.num_blocks
        self.num_host_blocks = spec.num_host_blocks
        self._manager = SelfAttnBlockSpaceManager(
            block_size=spec.block_size,
            num_gpu_blocks=spec.num_blocks,
            num_cpu_blocks=spec.num_host_blocks,
            watermark=ENGINE_WATERMARK,
            enable_caching=enable_caching,
        )
        self._gpu = self._manager.block_allocator._allocators[Device.GPU]
        self._cpu = self._manager.block_allocator._allocators[Device.CPU]
        self._caching = enable_caching
        # v0 makes full blocks matchable (content-hashed) when it allocates them, recomputes a fully cached prompt's
        # last token inside the cached block, and its scheduler preempts only requests it has not scheduled in the
        # current round, unless a chunked prefill is preempted part-way. With prefix caching its host allocator
        # deduplicates full blocks by content too (a swap-out may share a host block), and a copy-on-write into a
        # forked tail that fills the block is deduplicated against an identical full block, the copy's fresh
        # destination freed with the copy still ordered. The block manager has no rollback (drafts live in lookahead
        # slots) and no eviction: it evicts only when it allocates, and its reset_prefix_cache refuses while any block
        # is in use; neither method exists.
        self.capabilities = Capabilities(
            fork=fork,
            prefix_cache=enable_caching,
            namespaces=enable_caching,
            swap=spec.num_host_blocks > 0,
            inflight_window=0,
            reserved_blocks=self._manager.watermark_blocks,
            introspection=True,
            hits_scheduled_writes=True,
            shares_scheduled_blocks=True,
            free_lands_scheduled_writes=True,
            preempt_scheduled=preempt_scheduled,
            recomputes_in_place=enable_caching,
            shares_host_blocks=enable_caching and spec.num_host_blocks > 0,
            dedupes_copied_tail=enable_caching and fork,
        )
        self.sequences = SequenceLedger()  # the sequences held and their phases; raises the misuse errors
        self._live: dict[SeqId, _Request] = {}  # running or swapped-out sequence -> its request
        self._preempted: dict[SeqId, _Request] = {}  # preempted sequence -> its request, reset for recomputation
        self._lora_ids: dict[Namespace, int] = {}
        self._seq_ids = itertools.count()
        self._last_completed = -1

    # -- the contract --------------------------------------------------------------------------------------------

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        from vllm.core.interfaces import AllocStatus
        from vllm.sequence import SequenceStatus

        self.sequences.check_admit(seq, tokens)
        request = self._preempted.get(seq)
        if request is not None and (request.namespace, request.tokens) != (tuple(namespace), tuple(tokens)):
            raise InvalidArgument(
                f"admit: preempted sequence {seq!r} comes back with other tokens or namespace: "
                f"expected {request.namespace!r} {list(request.tokens)}, "
                f"got {tuple(namespace)!r} {list(tokens)}"
            )
        if request is None:
            request = self._new_request(seq, tuple(namespace), tokens)
        num_cached = self._num_cached_tokens(request)
        status = self._manager.can_allocate(request.group)
        if status != AllocStatus.OK:
            self._manager.remove_seq_from_computed_blocks_tracker(request.seq)
            raise OutOfBlocks(
                f"admit: can_allocate({seq!r}, {len(tokens)} tokens) is {status.name} with "
                f"{self._manager.get_num_free_gpu_blocks()} free device block(s) and watermark "
                f"{self._manager.watermark_blocks}",
                needed=-(-len(tokens) // self.block_size),
                available=self._manager.get_num_free_gpu_blocks(),
            )
        self._manager.allocate(request.group)
        request.seq.status = SequenceStatus.RUNNING
        self._preempted.pop(seq, None)
        self._live[seq] = request
        self.sequences.admitted(seq)
        return AdmitResult(self.block_table(seq), num_cached)

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        from vllm.logprobs import Logprob

        request = self._running(seq, "grow")
        self.sequences.check_tokens("grow", seq, tokens)
        if not self._manager.can_append_slots(request.group, num_lookahead_slots=len(tokens)):
            raise OutOfBlocks(
                f"grow: can_append_slots({seq!r}, {len(tokens)} slots) is False with "
                f"{self._manager.get_num_free_gpu_blocks()} free device block(s)",
                available=self._manager.get_num_free_gpu_blocks(),
            )
        old_len = request.seq.get_len()
        for token in tokens:
            request.seq.append_token_id(token, {token: Logprob(logprob=0.0)})
        cows = self._manager.append_slots(request.seq, num_lookahead_slots=0)
        table = self.block_table(seq)
        size = self.block_size
        slots = [Slot(table[p // size], p % size) for p in range(old_len, old_len + len(tokens))]
        return GrowResult(slots, [BlockCopy(src=src, dst=dst) for src, dst in cows])

    def fork(self, parent: SeqId, child: SeqId) -> None:
        from vllm.sequence import SequenceGroup

        self.sequences.check_fork(parent, child)
        source = self._live[parent]
        child_seq = source.seq.fork(next(self._seq_ids))
        self._manager.fork(source.seq, child_seq)
        group = SequenceGroup(
            request_id=child, seqs=[child_seq], arrival_time=0.0, lora_request=source.group.lora_request
        )
        self._preempted.pop(child, None)
        self._live[child] = _Request(child_seq, group, source.namespace)
        self.sequences.admitted(child)

    def free(self, seq: SeqId) -> None:
        from vllm.sequence import SequenceStatus

        self.sequences.live(seq, "free")
        request = self._live.pop(seq)
        request.seq.status = SequenceStatus.FINISHED_ABORTED
        self._manager.free(request.seq)
        self.sequences.freed(seq)

    def preempt(self, seq: SeqId) -> None:
        from vllm.sequence import SequenceStatus

        request = self._running(seq, "preempt")
        request.seq.status = SequenceStatus.WAITING
        self._manager.free(request.seq)
        request.seq.reset_state_for_recompute()
        del self._live[seq]
        self._preempted[seq] = request
        self.sequences.preempted(seq)

    def swap_out(self, seq: SeqId) -> SwapResult:
        from vllm.sequence import SequenceStatus

        request = self._running(seq, "swap_out")
        if not self.capabilities.swap:
            raise Unsupported("swap_out: this block manager has no host blocks")
        if not self._manager.can_swap_out(request.group):
            raise OutOfBlocks(
                f"swap_out: can_swap_out({seq!r}) is False with "
                f"{self._manager.get_num_free_cpu_blocks()} free host block(s)",
                available=self._manager.get_num_free_cpu_blocks(),
            )
        mapping = self._manager.swap_out(request.group)
        request.seq.status = SequenceStatus.SWAPPED
        self.sequences.swapped_out(seq)
        return SwapResult(mapping)

    def swap_in(self, seq: SeqId) -> SwapResult:
        from vllm.core.interfaces import AllocStatus
        from vllm.sequence import SequenceStatus

        self.sequences.swapped(seq, "swap_in")
        request = self._live[seq]
        status = self._manager.can_swap_in(request.group, num_lookahead_slots=0)
        if status != AllocStatus.OK:
            raise OutOfBlocks(
                f"swap_in: can_swap_in({seq!r}) is {status.name} with "
                f"{self._manager.get_num_free_gpu_blocks()} free device block(s) and watermark "
                f"{self._manager.watermark_blocks}",
                available=self._manager.get_num_free_gpu_blocks(),
            )
        mapping = self._manager.swap_in(request.group)
        request.seq.status = SequenceStatus.RUNNING
        self.sequences.admitted(seq)
        return SwapResult(mapping)

    def step_completed(self, step: int) -> None:
        if step <= self._last_completed:
            raise InvalidArgument(f"step_completed({step}) after step {self._last_completed} completed")
        self._last_completed = step
        batch = [request for request in self._live.values() if self._is_running(request)]
        for request in batch:
            self._manager.get_block_table(request.seq)
            self._manager.access_all_blocks_in_seq(request.seq, float(step))
            if self._caching:
                self._manager.get_common_computed_block_ids([request.seq])
        for request in batch:
            self._manager.mark_blocks_as_computed(request.group, request.seq.data.get_num_uncomputed_tokens())
        for request in batch:
            request.group.update_num_computed_tokens(request.seq.data.get_num_uncomputed_tokens())

    def library_block_name(self, block: int) -> str:
        """Block ``block`` as vLLM v0 numbers it (the same id), for ``kvfuzz show``."""
        return f"vLLM v0 block {block}"

    def block_table(self, seq: SeqId) -> tuple[int, ...]:
        return tuple(self._manager.get_block_table(self._running(seq, "block_table").seq))

    # -- introspection, read from the device and host allocators' own state ---------------------------------------

    def refcount(self, block: int) -> int:
        return self._gpu._refcounter.get(block)

    def free_blocks(self) -> Collection[int]:
        """The device allocator's free list (the hashless allocator's, under prefix caching)."""
        pool = self._gpu._hashless_allocator if self._caching else self._gpu
        return pool._free_block_indices

    def cached_blocks(self) -> Collection[int]:
        """Unreferenced blocks the evictor holds with their content hash (none without prefix caching)."""
        return self._gpu.evictor.free_table.keys() if self._caching else ()

    def pending_blocks(self) -> Collection[int]:
        return ()

    def host_free_blocks(self) -> list[int]:
        """The host allocator's free list and, under prefix caching, the unreferenced host blocks its evictor holds
        with their hash, numbered from 0 as the swap mappings number them (host ids follow the device ids)."""
        pool = self._cpu._hashless_allocator if self._caching else self._cpu
        unreferenced = [*pool._free_block_indices, *(self._cpu.evictor.free_table.keys() if self._caching else ())]
        return [block - self.num_blocks for block in unreferenced]

    # -- helpers -------------------------------------------------------------------------------------------------

    def _new_request(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> _Request:
        from vllm.sequence import Sequence, SequenceGroup

        lora = self._lora_request(namespace)
        vllm_seq = Sequence(
            next(self._seq_ids), {"type": "token", "prompt_token_ids": list(tokens)}, self.block_size, lora_request=lora
        )
        return _Request(
            vllm_seq, SequenceGroup(request_id=seq, seqs=[vllm_seq], arrival_time=0.0, lora_request=lora), namespace
        )

    def _lora_request(self, namespace: Namespace) -> Optional[Any]:
        """The LoRA adapter standing for ``namespace``: a distinct ``lora_int_id`` per namespace, none for ()."""
        from vllm.lora.request import LoRARequest

        if not namespace:
            return None
        lora_id = self._lora_ids.setdefault(namespace, len(self._lora_ids) + 1)
        return LoRARequest(lora_name=repr(namespace), lora_int_id=lora_id, lora_path=f"/kvfuzz/lora/{lora_id}")

    def _num_cached_tokens(self, request: _Request) -> int:
        """The scheduler's cached-token count for a prompt: full computed blocks, less one token on a full hit."""
        if not self._caching:
            return 0
        cached = max(0, self._manager.get_num_cached_tokens(request.seq) - request.seq.get_num_computed_tokens())
        if cached and cached >= request.seq.get_len():
            cached = request.seq.get_len() - 1
        return cached

    def _is_running(self, request: _Request) -> bool:
        from vllm.sequence import SequenceStatus

        return request.seq.status == SequenceStatus.RUNNING

    def _running(self, seq: SeqId, op: str) -> _Request:
        """The running sequence's request (``sequences`` raises for any other)."""
        self.sequences.running(seq, op)
        return self._live[seq]


def block_space_manager(spec: PoolSpec) -> VllmV0BlockManager:
    """vLLM v0's block manager with prefix caching (``enable_prefix_caching=True``)."""
    return VllmV0BlockManager(spec, enable_caching=True)


def block_space_manager_no_caching(spec: PoolSpec) -> VllmV0BlockManager:
    """vLLM v0's block manager without prefix caching (its naive block allocator)."""
    return VllmV0BlockManager(spec, enable_caching=False)


def block_space_manager_without_fork(spec: PoolSpec) -> VllmV0BlockManager:
    """Prefix caching, fork not driven: vLLM 0.10.2's engine never forks (its Scheduler.fork_seq has no caller), and
    forking under prefix caching trips a latent assertion (corpus/vllm-v0-free-fork-child-*)."""
    return VllmV0BlockManager(spec, enable_caching=True, fork=False)


def block_space_manager_chunked_prefill(spec: PoolSpec) -> VllmV0BlockManager:
    """Prefix caching, fork not driven, and preemption of a sequence whose tokens are scheduled but not computed.

    v0 allocates (and registers) a whole prompt at admission, while chunked prefill computes it over several steps:
    preempting it part-way withdraws writes its registered blocks were counted on. kvfuzz's steps write everything
    scheduled, so it models that as preempting a sequence before its step."""
    return VllmV0BlockManager(spec, enable_caching=True, fork=False, preempt_scheduled=True)
