"""vLLM 0.33's hybrid KV cache (``HybridKVCacheCoordinator``) behind kvfuzz's contract, with two KV-cache groups.

A model that mixes full-attention layers with sliding-window layers gets one KV-cache group per kind, and vLLM's
``KVCacheManager`` then builds a ``HybridKVCacheCoordinator`` over them (with prefix caching; without it, a
``KVCacheCoordinatorNoPrefixCache``): one ``SingleTypeKVCacheManager`` per group, all allocating from one shared
``BlockPool``, each keeping its own table per request. The adapter is the scheduler shim of
:mod:`kvfuzz.adapters.vllm_v1` unchanged (admission, growth, frees, preemption, eviction), over a
``KVCacheConfig`` of two groups: group 0 full attention, group 1 a sliding window of ``sliding_window`` tokens, in
blocks of the same size, or (``kv_cache_manager_hybrid_sliding_double``) group 1 in blocks of twice group 0's, as a
model whose sliding-window layers store half the bytes per token gets them. The pool's ``block_size`` is then vLLM's
``hash_block_size`` (the gcd of the two) and group 0's, and the manager's ``scheduler_block_size`` is their lcm,
group 1's, to which vLLM aligns every hit. What the two groups add:

* two tables per sequence, declared as ``kv_groups`` (full attention, then the sliding window) and read back with
  ``group_block_tables``; ``block_table`` and the slots of ``admit`` and ``grow`` are group 0's, as the contract
  asks. A block the sliding-window manager drops (``remove_skipped_blocks``, called by ``allocate_slots`` before it
  checks for room, on the tokens whose step has completed) is vLLM's null block, reported as
  :data:`~kvfuzz.allocator.types.NULL_BLOCK`; the cached hit of the sliding-window group also starts with null
  entries for the blocks before the window.
* the hit: ``get_computed_blocks`` asks the coordinator's ``find_longest_cache_hit``, full attention first (the
  longest run of cached blocks from the start), then the sliding window within that bound (the latest position at
  which ``ceil((sliding_window - 1) / block_size)`` contiguous blocks are cached), and cuts the full-attention hit
  back to it: the hit reported is the one every group holds.
* one pool: block ``b`` is vLLM block ``b + 1`` in either group (vLLM's null block 0 never shows), a block is in
  one group's tables at a time (each group hashes its blocks under its own group id), and ``refcount``,
  ``free_blocks``, ``cached_blocks`` and ``pending_blocks`` read the one ``BlockPool``.

Declared, as for the single sliding-window group of :mod:`kvfuzz.adapters.vllm_v1`: no ``eviction_order`` and no
``complete_caching`` (the sliding-window group frees out-of-window blocks while the request runs, cached, so they
reach the free queue before the request's other blocks, and a hit needs only the blocks of the last window); and
``refusal_drops_window``: ``allocate_slots`` drops the sliding-window group's out-of-window blocks before it checks
for room, so a refused ``grow`` may still have released them. Speculative decoding and targeted eviction are not
driven here, nor deferred frees (W > 0): the sliding-window group's drops go to the free queue at once, past
the scheduler's deferred frees. vLLM drops only blocks that no step in flight reads (it counts the tokens whose
step has completed), but kvfuzz's W holds every released block alike, so it would report those drops as reused
inside the in-flight window (invariant 6).
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from kvfuzz.adapters.vllm_v1 import VllmOptions, VllmV1Allocator
from kvfuzz.allocator.types import KVGroup, PoolSpec, SeqId

CODE_UNDER_TEST = ("vllm", ("v1/core",))
"""What a campaign's --coverage measures of this adapter's allocator: vLLM's V1 KV cache manager over several KV cache
groups (kvfuzz.coverage.scope)."""

FULL_ATTENTION = "full attention"
"""The name of group 0, the full-attention layers."""

SLIDING_WINDOW = "sliding window"
"""The name of group 1, the sliding-window layers."""


class VllmHybridAllocator(VllmV1Allocator):
    """One vLLM ``KVCacheManager`` over a full-attention group and a sliding-window group (see the module docstring).

    ``options.sliding_window`` is the window of group 1 (required); group 0 is full attention. ``sliding_block_factor``
    makes group 1's blocks hold that many times the pool's ``block_size`` tokens (group 0's blocks hold
    ``block_size``, vLLM's ``hash_block_size``; the ``scheduler_block_size`` is their lcm, the larger).
    """

    def __init__(self, spec: PoolSpec, options: VllmOptions, sliding_block_factor: int = 1) -> None:
        if sliding_block_factor < 1:
            raise ValueError(f"VllmHybridAllocator: sliding_block_factor must be >= 1, got {sliding_block_factor}")
        self._sliding_block_size = sliding_block_factor * spec.block_size  # tokens per block of group 1
        if options.sliding_window is None:
            raise ValueError("VllmHybridAllocator: the sliding-window group needs options.sliding_window")
        if options.speculative_tokens or options.kv_connector or options.inflight_window:
            raise ValueError(
                "VllmHybridAllocator: speculative decoding, KV connectors and deferred frees are not driven here"
            )
        super().__init__(spec, options)
        self.capabilities = attrs.evolve(
            self.capabilities,
            sliding_window=None,
            kv_groups=(
                KVGroup(FULL_ATTENTION),
                KVGroup(
                    SLIDING_WINDOW,
                    sliding_window=options.sliding_window,
                    block_size=None if sliding_block_factor == 1 else self._sliding_block_size,
                ),
            ),
        )

    def _scheduler_block_size(self) -> int:
        """The lcm of the groups' block sizes (vLLM's ``resolve_kv_cache_block_sizes``): group 1's, a multiple of
        group 0's."""
        return self._sliding_block_size

    def _kv_cache_groups(self, options: VllmOptions) -> list[Any]:
        """Two groups, so vLLM builds its ``HybridKVCacheCoordinator`` (with prefix caching): full attention in blocks
        of the pool's block size, the sliding window in blocks of ``sliding_block_factor`` times that."""
        group = self._vllm.KVCacheGroupSpec
        return [
            group(["kvfuzz.full_attn"], self._kv_spec(None)),
            group(["kvfuzz.sliding_attn"], self._kv_spec(options.sliding_window, self._sliding_block_size)),
        ]

    def group_block_tables(self, seq: SeqId) -> tuple[tuple[int, ...], ...]:
        """The full-attention table, then the sliding-window table (``NULL_BLOCK`` where vLLM has its null block)."""
        return self._group_tables(seq, "group_block_tables")


def _factory(
    name: str, doc: str, sliding_block_factor: int = 1, **options: Any
) -> Callable[[PoolSpec], VllmHybridAllocator]:
    def factory(spec: PoolSpec) -> VllmHybridAllocator:
        return VllmHybridAllocator(spec, VllmOptions(**options), sliding_block_factor)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = doc
    return factory


kv_cache_manager_hybrid = _factory(
    "kv_cache_manager_hybrid",
    "Full attention and an 8-token sliding window in two KV-cache groups, prefix caching, W = 0.",
    sliding_window=8,
)
kv_cache_manager_hybrid_no_prefix_cache = _factory(
    "kv_cache_manager_hybrid_no_prefix_cache",
    "Full attention and an 8-token sliding window in two KV-cache groups, no prefix caching, W = 0.",
    sliding_window=8,
    prefix_caching=False,
)
kv_cache_manager_hybrid_sliding_double = _factory(
    "kv_cache_manager_hybrid_sliding_double",
    "Full attention in blocks of the pool's block size and a 16-token sliding window in blocks of twice that, two "
    "KV-cache groups of different block sizes (hash_block_size the smaller, scheduler_block_size the larger), "
    "prefix caching, W = 0.",
    sliding_block_factor=2,
    sliding_window=16,
)
