"""SGLang's radix cache with its host tier (HiCache), behind kvfuzz's contract.

SGLang 0.5.23 has no class named ``HiRadixCache`` any more: the host tier is ``UnifiedRadixCache.init_hicache``,
which attaches a host pool (``MHATokenToKVPoolHost``, in a ``HostPoolGroup``) and a ``HybridCacheController`` to
the radix tree, exactly as ``--enable-hierarchical-cache`` does (``mem_cache.registry.create_unified_radix_cache``).
This adapter builds that stack on the CPU over a one-layer ``MHATokenToKVPool`` and drives it as the scheduler does,
reusing :class:`~kvfuzz.adapters.sglang.adapter.SGLangRadixAllocator`'s lifecycle (admission, decode and extend
allocation, checkpoints, finish, abort, retraction) and adding what the scheduler adds with HiCache on:

* admission: ``Req.init_next_round_input`` matches on the device and, past the device prefix, on the host
  (``host_hit_length``, ``best_match_node``); ``PrefillAdder`` pins the device match and checks the prefill budget,
  and with a host hit pins the host match (host lock and device lock) and calls ``init_load_back``, which allocates
  fresh device pages and queues a host-to-device copy into them (``HybridCacheController.load``), or declines a hit
  under ``load_back_threshold`` (SGLang's own default, 10 tokens, kept as ``init_hicache`` sets it); on success the
  request's prefix grows by what it loaded and its lock moves to the loaded node.
* step launch (``take_transfers``): the scheduler's ``ready_to_load_host_cache`` before the batch's forward
  (``start_loading``: the loads its admissions queued are copied).
* HiCache events: ``check_hicache_events`` (``flush_pending_backups``, ``writing_check`` and ``loading_check``) runs
  where the scheduler's event loop runs it, once the results of a step are processed, and after a finished
  request is released (its insert queues the write-through of its new nodes).
* write policy: ``write_through`` (every inserted node is backed up to the host when inserted), ``write_back``
  (backed up when evicted from the device, synchronously) or ``write_through_selective`` (backed up on its second
  hit).

Driven as a second cache tier (``host_cache``). A thin wrapper around the controller records, without changing
them, the copies SGLang makes, as kvfuzz blocks: ``load`` (a load-back's (host page, device page) pairs, returned
by the admission as ``AdmitResult.loads``, whose ``num_cached_tokens`` covers the loaded span; kvfuzz lands them at
the next launch, where SGLang's ``start_loading`` copies them) and ``start_writing`` (every backup, write-through,
write-back or selective, as SGLang submits it and copies it at once; returned by the next ``take_transfers`` as
stores flushed at that launch, before its loads and writes: between steps kvfuzz writes no device block and reads
no host block, so that is the order SGLang copied in). A load-back's pages stay locked until its acknowledgement
at the event poll after the step that ran it; if its request is released first they are listed pending, which
kvfuzz allows for a block a load still fills, until that step completes.

Geometry: kvfuzz's host block ``h`` is the host pool's page ``h`` (host token slots ``h * page_size ..``); SGLang
sizes the host pool from ``hicache_ratio`` plus one page, and the adapter picks the ratio that gives exactly
``max(1, spec.num_host_blocks)`` pages, which it declares as ``num_host_blocks``. The host pool is a plain CPU tensor:
SGLang registers host memory with CUDA (``cudaHostRegister``) for every device type it knows, and has no CPU entry,
so the adapter registers one that allocates without pinning (pinning only speeds DMA; no index or ownership changes).

Introspection. Over the Python tree core (``tree_core_backend="python"``, SGLang's fallback when its Rust core is
unavailable), which exposes its nodes, cached blocks are the device pages of nodes no request or transfer locks, and
the host free set is the host pool's free pages plus the host pages of nodes whose host copy no one pins (what
``evict_host`` may drop); kvfuzz checks the host pool at quiescence: every host page free or reusable, once. SGLang's
default Rust tree core exposes no nodes; over it (the ``_rust`` factories) cached blocks come from the walk its KV
canary makes (``walk_for_kv_canary``, unlocked nodes only) and the host pool is not listed. Over either core,
pending blocks are the device pages of locked nodes that no running request maps (a released request's load-back
awaiting its acknowledgement).

Not declared: swap (SGLang's per-request host backup, ``backup_kv_cache``/``restore_kv_cache``, serves only decode
servers of prefill/decode disaggregation), fork, rollback, as in the device-only adapter. W = 0: the transfers on a
CPU stream complete before the next event poll, and device pages stay locked until their copy is acknowledged, so
nothing is handed out early; the adapter polls right after a release that queued a write-through, so a page held
only by an unacknowledged write-through is never seen (the contract has no set for it).
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Any, Collection

import attrs
import torch

from kvfuzz.adapters.sglang._engine import in_context, sglang
from kvfuzz.adapters.sglang.adapter import SGLangRadixAllocator, _Phase
from kvfuzz.allocator.types import AdmitResult, HostTransfers, Namespace, PoolSpec, SeqId, Tokens

CODE_UNDER_TEST = ("sglang", ("srt/mem_cache",))
"""What a campaign's --coverage measures of this adapter's allocator: SGLang's hierarchical cache, its host pool and
radix caches (kvfuzz.coverage.scope)."""

WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")
"""SGLang's ``--hicache-write-policy`` values."""


def _unpinned_host_tensor(
    dims: tuple[int, ...],
    dtype: torch.dtype,
    device: str,
    pin_memory: bool,
    allocator: Any,
    registration_granularity_bytes: int | None = None,
) -> torch.Tensor:
    """A host pool buffer on a machine without an accelerator: the same allocation, not registered for DMA."""
    return allocator.allocate(dims, dtype=dtype, device=device)


def _copy_pages_direct(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """``sgl_kernel.kvcacheio.transfer_kv_direct`` in torch: per layer buffer, token rows ``src_indices`` of the
    source to rows ``dst_indices`` of the destination (the "direct" I/O backend with the layer-first layout)."""
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices.to(torch.int64)] = src[src_indices.to(torch.int64)].to(dst.device)


@functools.lru_cache(maxsize=None)
def hicache() -> Any:
    """SGLang's HiCache classes, imported once, with the CPU host-buffer allocation registered."""
    sglang()  # the torchvision stand-in, before any SGLang import
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host import common as host_common
    from sglang.srt.mem_cache.pool_host import mha as host_mha
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    # Warnings about what kvfuzz asks for on purpose, once per allocator or per eviction: a host pool smaller than
    # the device pool, CPU events that cannot time transfers, write-back dropping a subtree when the host is full.
    for module in ("pool_host.base", "l2_transfer", "unified_radix_cache"):
        logging.getLogger(f"sglang.srt.mem_cache.{module}").setLevel(logging.ERROR)
    host_common.ALLOC_MEMORY_FUNCS.setdefault("cpu", _unpinned_host_tensor)
    if not hasattr(host_mha, "transfer_kv_direct"):  # bound only where sgl_kernel (CUDA, ROCm, XPU) loads
        vars(host_mha)["transfer_kv_direct"] = _copy_pages_direct
    return types.SimpleNamespace(
        InitLoadBackParams=InitLoadBackParams,
        MHATokenToKVPool=MHATokenToKVPool,
        FULL=ComponentType.FULL,
        UnifiedRadixCache=UnifiedRadixCache,
    )


def _page_pairs(source: torch.Tensor, destination: torch.Tensor, page_size: int, what: str) -> list[tuple[int, int]]:
    """The (source page, destination page) pairs of a copy SGLang queues from token slots ``source`` to token slots
    ``destination``, which kvfuzz can express only as whole pages, each slot to the same offset."""
    pairs: dict[int, int] = {}
    for src, dst in zip(source.tolist(), destination.tolist()):
        page = dst // page_size
        if src % page_size != dst % page_size or pairs.setdefault(src // page_size, page) != page:
            raise RuntimeError(f"SGLang's {what} copies slot {src} to slot {dst}, not page to page at one offset")
    if len(source) != len(pairs) * page_size:
        raise RuntimeError(f"SGLang's {what} copies {len(source)} slots, not the whole of pages {sorted(pairs)}")
    return list(pairs.items())


@attrs.define
class _TransferLog:
    """The copies SGLang's cache controller makes between the device and host pools, as kvfuzz numbers the blocks
    (device page ``p`` is block ``p - 1``, host page ``h`` host block ``h``), kept until the adapter reports them.

    Invariant kept: ``stores`` holds, in submission order, every device-to-host copy the controller has submitted
    (``start_writing``, which copies at once) since the last step launch; ``loads`` every host-to-device copy the
    controller has queued (``load``) since the last admission returned.
    """

    stores: list[tuple[int, int]] = attrs.field(factory=list)  # (device block, host block), copied already
    loads: list[tuple[int, int]] = attrs.field(factory=list)  # (host block, device block), copied at the next launch


def _record_transfers(controller: Any, log: _TransferLog, page_size: int) -> None:
    """Wrap the controller's ``start_writing`` and ``load`` so that each copy is recorded in ``log`` before (for a
    write) or after (for a load) it goes through unchanged."""
    submit_writes, queue_load = controller.start_writing, controller.load

    def start_writing() -> None:
        for op in controller.write_queue:
            pairs = _page_pairs(op.device_indices, op.host_indices, page_size, "backup")
            log.stores += [(device - 1, host) for device, host in pairs]
        submit_writes()

    def load(host_indices: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        device_indices = queue_load(host_indices, *args, **kwargs)
        if device_indices is not None:
            pairs = _page_pairs(host_indices, device_indices, page_size, "load-back")
            log.loads += [(host, device - 1) for host, device in pairs]
        return device_indices

    vars(controller).update(start_writing=start_writing, load=load)  # instance attributes shadow the methods


class HiCacheAllocator(SGLangRadixAllocator):
    """kvfuzz's contract over SGLang's UnifiedRadixCache with HiCache (host tier) attached, over either tree core;
    the subclasses read the tree's state each core exposes."""

    tree_core_backend = "python"  # SGLang's TreeCore implementation: "python" or "rust" (its default)

    def __init__(self, spec: PoolSpec, *, write_policy: str = "write_through") -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy {write_policy!r}: SGLang knows {', '.join(WRITE_POLICIES)}")
        host_pages = max(1, spec.num_host_blocks)
        engine = sglang()
        # SGLang's host pool has int(device tokens * ratio) // page + 1 pages; this ratio gives host_pages.
        ratio = ((host_pages - 1) * spec.block_size + 0.5) / (spec.num_blocks * spec.block_size)
        # The serving options --enable-hierarchical-cache --hicache-ratio R --hicache-write-policy P
        # --hicache-io-backend direct --hicache-mem-layout layer_first set; init_hicache and the tree read them.
        self.server_args = engine.ServerArgs(
            model_path="dummy",
            device="cpu",
            page_size=spec.block_size,
            enable_hierarchical_cache=True,
            hicache_ratio=ratio,
            hicache_write_policy=write_policy,
            hicache_io_backend="direct",
            hicache_mem_layout="layer_first",
        )
        self.runtime_context = engine.create_context(self.server_args, role="scheduler")  # active around each call
        self.transfers = _TransferLog()  # the controller's copies not yet reported to kvfuzz
        super().__init__(spec)
        self.capabilities = attrs.evolve(self.capabilities, host_cache=True)
        self.num_host_blocks = self.host_pool.page_num  # as SGLang sized it

    @in_context
    def _build(self, spec: PoolSpec) -> None:
        engine, hi = sglang(), hicache()
        page = spec.block_size
        kv_pool = hi.MHATokenToKVPool(
            spec.num_blocks * page,
            page_size=page,
            dtype=torch.float16,
            head_num=1,
            head_dim=4,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
        self.token_pool = engine.PagedTokenToKVPoolAllocator(
            spec.num_blocks * page, page_size=page, dtype=torch.float16, device="cpu", kvcache=kv_pool, need_sort=False
        )
        self.req_to_token_pool = engine.ReqToTokenPool(
            size=spec.num_blocks, max_context_len=(spec.num_blocks + 1) * page, device="cpu", enable_memory_saver=False
        )
        params = engine.CacheInitParams(
            disable=False,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_pool,
            page_size=page,
            tree_components=(hi.FULL,),
            tree_core_backend=self.tree_core_backend,
        )
        self.tree = hi.UnifiedRadixCache(params)  # the radix tree, then its host tier attached
        self.tree.init_hicache(self.server_args, params)  # load_back_threshold: SGLang's own, 10 tokens
        self.host_pool = self.tree.cache_controller.mem_pool_host.anchor_entry.host_pool  # the KV host pool
        _record_transfers(self.tree.cache_controller, self.transfers, page)

    # -- the contract, with the host tier ------------------------------------------------------------------------

    @in_context
    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        """The device-only admission, whose match may load host pages back (``_extend_match``): their copies are
        reported as ``loads``, and the request's cached prefix covers them."""
        try:
            result = SGLangRadixAllocator.admit.__wrapped__(self, seq, namespace, tokens)
        finally:
            loads, self.transfers.loads = self.transfers.loads, []
        return attrs.evolve(result, loads=loads)

    @in_context
    def take_transfers(self, step: int) -> HostTransfers:
        """The scheduler's launch of a batch: ``ready_to_load_host_cache`` starts the load-backs its admissions
        queued (kvfuzz lands them now, from the admissions' ``loads``). The backups SGLang submitted since the last
        launch are reported too, as stores flushed at once: SGLang copied each when it submitted it, between steps,
        and until this launch kvfuzz neither writes a device block nor reads a host block, so landing them now,
        before the loads and the step's writes, is the order SGLang copied in."""
        self.tree.ready_to_load_host_cache()
        stores, self.transfers.stores = self.transfers.stores, []
        return HostTransfers(stores, flushed=stores)

    @in_context
    def step_completed(self, step: int) -> None:
        SGLangRadixAllocator.step_completed.__wrapped__(self, step)
        self._poll_events()

    @in_context
    def free(self, seq: SeqId) -> None:
        SGLangRadixAllocator.free.__wrapped__(self, seq)
        self._poll_events()

    # -- introspection -------------------------------------------------------------------------------------------

    def pending_blocks(self) -> Collection[int]:
        """Device pages the tree keeps locked though no running request maps them: those a load-back fills, from
        the release of the request it was for until the load is acknowledged after the step that runs it."""
        referenced = {
            block for state in self._requests.values() if state.phase is _Phase.RUNNING for block in self._table(state)
        }
        return [block for block in self._locked_blocks() if block not in referenced]

    def _locked_blocks(self) -> list[int]:
        """Device pages of tree nodes some request or transfer locks."""
        raise NotImplementedError

    # -- the scheduler's steps, with HiCache ---------------------------------------------------------------------

    def _extend_match(self, req: Any, lock: Any) -> Any:
        """``PrefillAdder.add_one_req`` with a host hit: pin the host match (host lock and device lock), load back,
        and on success take the request's prefix to the loaded node; SGLang declines a load of fewer than
        ``load_back_threshold`` tokens, and the request recomputes that span."""
        if not req.needs_host_load_back():
            return lock
        tree, hi = self.tree, hicache()
        node, promised = req.best_match_node, req.host_hit_length
        host_pin = tree.inc_host_lock_ref(node).to_dec_params()
        try:
            pin = tree.lock(node)
            try:
                loaded, last_node = tree.init_load_back(
                    hi.InitLoadBackParams(best_match_node=node, host_hit_length=promised, req=req)
                )
            finally:
                tree.unlock(pin)
        finally:
            tree.dec_host_lock_ref(node, host_pin)
        req.host_loaded_length, req.last_node = loaded, last_node
        if 0 < loaded < promised:  # the scheduler's own check
            raise RuntimeError(f"HiCache load-back committed {loaded} of the {promised} host-hit tokens")
        if not loaded:
            return lock
        req.prefix_len += loaded
        req.kv.cache_protected_len = req.prefix_len
        request_lock = tree.lock(req.last_node)
        tree.unlock(lock)
        return request_lock

    def _poll_events(self) -> None:
        """The event loop's ``check_hicache_events``: submit queued backups, acknowledge finished write-throughs and
        load-backs."""
        self.tree.check_hicache_events()


class SGLangHiCacheAllocator(HiCacheAllocator):
    """Over SGLang's Python tree core, whose nodes list their device and host pages: device and host pools checked."""

    tree_core_backend = "python"

    def _nodes(self) -> list[Any]:
        """Every node of the tree but the roots, with its FULL component's data."""
        full = hicache().FULL
        found: list[Any] = []
        stack = list(self.tree.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            found.append(node.component(full))
        return found

    def _page_ids(self, slots: torch.Tensor) -> list[int]:
        return [int(slot) // self.block_size for slot in slots[:: self.block_size].tolist()]

    def cached_blocks(self) -> Collection[int]:
        """Device pages of tree nodes that no request and no transfer locks: what eviction may drop or demote."""
        return [
            page - 1
            for data in self._nodes()
            if data.value is not None and data.lock_ref == 0
            for page in self._page_ids(data.value)
        ]

    def _locked_blocks(self) -> list[int]:
        return [
            page - 1
            for data in self._nodes()
            if data.value is not None and data.lock_ref > 0
            for page in self._page_ids(data.value)
        ]

    def host_free_blocks(self) -> Collection[int]:
        """The host pool's free pages, and the host pages of nodes whose host copy nobody pins (``evict_host`` may
        drop them)."""
        pool = self.host_pool
        free_slots = torch.cat([pool.free_slots, *pool.release_slots]) if pool.release_slots else pool.free_slots
        held = [
            page
            for data in self._nodes()
            if data.host_value is not None and data.host_lock_ref == 0
            for page in self._page_ids(data.host_value)
        ]
        return self._page_ids(free_slots) + held


class SGLangHiCacheRustAllocator(HiCacheAllocator):
    """Over SGLang's Rust tree core (its default), which lists only the device pages of unlocked nodes (the walk its
    KV canary makes): the device pool is checked, the host pool only through SGLang's own assertions."""

    tree_core_backend = "rust"

    def cached_blocks(self) -> Collection[int]:
        """Device pages of tree nodes no request or transfer locks (``walk_for_kv_canary(unlocked_only=True)``)."""
        return self._walk(unlocked_only=True)

    def _locked_blocks(self) -> list[int]:
        unlocked = set(self._walk(unlocked_only=True))
        return [block for block in self._walk(unlocked_only=False) if block not in unlocked]

    def _walk(self, *, unlocked_only: bool) -> list[int]:
        """The device pages of the tree's nodes (those no one locks, or all), one slot per page: its first."""
        slots = self.tree.tree_core.walk_for_kv_canary(unlocked_only, False).slot_indices
        page = self.block_size
        return [slot // page - 1 for slot in slots.tolist() if slot % page == 0]


def hiradix_cache(spec: PoolSpec) -> SGLangHiCacheAllocator:
    """SGLang's radix cache with HiCache, write-through (every inserted node backed up to the host at once)."""
    return SGLangHiCacheAllocator(spec)


def hiradix_cache_write_back(spec: PoolSpec) -> SGLangHiCacheAllocator:
    """The same, write-back: a node is backed up to the host when the device evicts it."""
    return SGLangHiCacheAllocator(spec, write_policy="write_back")


def hiradix_cache_write_through_selective(spec: PoolSpec) -> SGLangHiCacheAllocator:
    """The same, write-through-selective: a node is backed up on its second hit."""
    return SGLangHiCacheAllocator(spec, write_policy="write_through_selective")


def hiradix_cache_rust(spec: PoolSpec) -> SGLangHiCacheRustAllocator:
    """Write-through over SGLang's default (Rust) tree core; its host pool is not listed."""
    return SGLangHiCacheRustAllocator(spec)


def hiradix_cache_rust_write_back(spec: PoolSpec) -> SGLangHiCacheRustAllocator:
    """Write-back over SGLang's default (Rust) tree core."""
    return SGLangHiCacheRustAllocator(spec, write_policy="write_back")
