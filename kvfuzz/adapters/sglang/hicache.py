"""SGLang's radix cache with its host tier (HiCache), behind kvfuzz's contract.

SGLang 0.5.23 has no class named ``HiRadixCache`` any more: the host tier is ``UnifiedRadixCache.init_hicache``,
which attaches a host pool (``MHATokenToKVPoolHost``, in a ``HostPoolGroup``) and a ``HybridCacheController`` to
the radix tree, exactly as ``--enable-hierarchical-cache`` does (``mem_cache.registry.create_unified_radix_cache``).
This adapter builds that stack on the CPU over a one-layer ``MHATokenToKVPool`` and drives it as the scheduler does,
reusing :class:`~kvfuzz.adapters.sglang.adapter.SGLangRadixAllocator`'s lifecycle (admission, decode and extend
allocation, checkpoints, finish, abort, retraction) and adding what the scheduler adds with HiCache on:

* admission: ``Req.init_next_round_input`` matches on the device and, past the device prefix, on the host
  (``host_hit_length``, ``best_match_node``); with a host hit, ``PrefillAdder`` pins the match (device lock and host
  lock) and calls ``init_load_back``; the request's prefix grows by what it loaded.
* HiCache events: ``check_hicache_events`` (``writing_check`` and ``loading_check``) runs where the scheduler's event
  loop runs it, once the results of a step are processed, and after a finished request is released (its insert
  queues the write-through of its new nodes).
* write policy: ``write_through`` (every inserted node is backed up to the host when inserted), ``write_back``
  (backed up when evicted from the device) or ``write_through_selective`` (backed up on its second hit).

What kvfuzz's contract cannot express, and so what the adapter does not drive: **load-back**. A host hit makes
``init_load_back`` allocate fresh device pages and queue a host-to-device copy into them, and the request's prefix
then covers those pages. kvfuzz plays the engine that performs every copy an allocator orders, but ``admit`` returns
no copies, and no operation reports the device-to-host copies of write-through or write-back, so kvfuzz's pools
cannot hold what the loaded pages would hold: every load-back would read as a hit on unwritten slots. The adapter
therefore runs HiCache with ``load_back_threshold`` above any prompt: ``init_load_back`` is called as the scheduler
calls it and declines (it takes and drops its locks, as it does for SGLang's own host hits under 10 tokens), and the
request recomputes its host-hit span, whose insert then lands on the host-only nodes. See docs/real-allocators.md.

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
canary makes (``walk_for_kv_canary``, unlocked nodes only) and the host pool is not listed.

Not declared: swap (SGLang's per-request host backup, ``backup_kv_cache``/``restore_kv_cache``, serves only decode
servers of prefill/decode disaggregation), fork, rollback, eviction, as in the device-only adapter. W = 0: the
transfers on a CPU stream complete before the next event poll, and device pages stay locked until their write is
acknowledged, so nothing is handed out early.
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Any, Collection

import torch

from kvfuzz.adapters.sglang._engine import in_context, sglang
from kvfuzz.adapters.sglang.adapter import SGLangRadixAllocator
from kvfuzz.allocator.types import PoolSpec, SeqId

WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")
"""SGLang's ``--hicache-write-policy`` values."""

NO_LOAD_BACK = 1 << 40
"""``load_back_threshold`` above any prompt: ``init_load_back`` declines every host hit (see the module doc)."""


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
        super().__init__(spec)
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
        self.tree.init_hicache(self.server_args, params)
        self.tree.load_back_threshold = NO_LOAD_BACK
        self.host_pool = self.tree.cache_controller.mem_pool_host.anchor_entry.host_pool  # the KV host pool

    # -- the scheduler's steps, with HiCache ---------------------------------------------------------------------

    def _admit_req(self, seq: SeqId, req: Any, length: int) -> int:
        """Match, then, with a host hit, ``PrefillAdder``'s load-back attempt; then the device-only admission."""
        # The device admission matches again (init_next_round_input); its result is the same, since a declined
        # load-back leaves the tree as it was.
        req.init_next_round_input(self.tree)
        if req.needs_host_load_back():
            self._init_load_back(seq, req)
        return super()._admit_req(seq, req, length)

    def _init_load_back(self, seq: SeqId, req: Any) -> None:
        """``PrefillAdder.add_one_req`` with a host hit: pin the device match, pin the host match, load back."""
        tree, hi = self.tree, hicache()
        device_lock = tree.lock(req.last_node)
        try:
            host_pin = tree.inc_host_lock_ref(req.best_match_node).to_dec_params()
            try:
                loaded, _ = tree.init_load_back(
                    hi.InitLoadBackParams(
                        best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req
                    )
                )
            finally:
                tree.dec_host_lock_ref(req.best_match_node, host_pin)
        finally:
            tree.unlock(device_lock)
        if loaded:  # load_back_threshold no longer declines: SGLang changed, and the adapter must follow
            raise RuntimeError(
                f"admit {seq!r}: SGLang loaded {loaded} host tokens back, which kvfuzz's admit cannot express"
            )

    def _poll_events(self) -> None:
        """The event loop's ``check_hicache_events``: acknowledge finished write-throughs and load-backs."""
        self.tree.check_hicache_events()

    @in_context
    def step_completed(self, step: int) -> None:
        SGLangRadixAllocator.step_completed.__wrapped__(self, step)
        self._poll_events()

    @in_context
    def free(self, seq: SeqId) -> None:
        SGLangRadixAllocator.free.__wrapped__(self, seq)
        self._poll_events()


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
        slots = self.tree.tree_core.walk_for_kv_canary(True, False).slot_indices
        page = self.block_size
        return [slot // page - 1 for slot in slots.tolist() if slot % page == 0]  # one slot per page: its first


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
