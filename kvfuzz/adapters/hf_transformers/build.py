"""Building a real transformers ``PagedAttentionCache`` for a kvfuzz pool geometry.

kvfuzz writes its own K/V into its own pools, so the library's cache tensor only has to exist: the model config is
the smallest one that gives whole-model blocks of exactly ``blocks_per_sector`` per sector (one layer, one KV head,
a head dimension chosen for the byte arithmetic). Transformers is imported here, when a factory is called, never
when kvfuzz is imported.
"""

from __future__ import annotations

from typing import Any

from kvfuzz.allocator.types import PoolSpec

_SECTOR_ALIGNMENT = 128
"""Bytes a cache sector is aligned to (``PagedAttentionCache`` takes the LCM of every block size and 128)."""


def _head_geometry(block_size: int, blocks_per_sector: int) -> tuple[int, Any]:
    """A (head_dim, dtype) whose whole-model block (one layer, one KV head, keys and values) makes sectors of exactly
    ``blocks_per_sector`` blocks."""
    import torch

    for dtype in (torch.float32, torch.float16):
        for head_dim in range(1, 65):
            block_bytes = 2 * head_dim * dtype.itemsize * block_size
            sector_bytes = block_bytes * blocks_per_sector
            if sector_bytes % _SECTOR_ALIGNMENT == 0 and all(
                (block_bytes * fewer) % _SECTOR_ALIGNMENT for fewer in range(1, blocks_per_sector)
            ):
                return head_dim, dtype
    raise ValueError(f"no head geometry gives sectors of {blocks_per_sector} blocks of {block_size} tokens")


def paged_attention_cache(spec: PoolSpec, *, allow_block_sharing: bool, blocks_per_sector: int = 1) -> Any:
    """A CPU ``PagedAttentionCache`` with ``spec.num_blocks`` blocks of ``spec.block_size`` tokens (its page size)."""
    if spec.num_blocks % blocks_per_sector:
        raise ValueError(f"{spec.num_blocks} blocks do not fill sectors of {blocks_per_sector} blocks")
    try:
        from transformers import LlamaConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
        from transformers.generation.continuous_batching.distributed import DistributedHelper
    except ImportError as error:
        raise ImportError(
            f"kvfuzz.adapters.hf_transformers needs transformers: pip install 'kvfuzz[transformers]' ({error})"
        ) from error

    head_dim, dtype = _head_geometry(spec.block_size, blocks_per_sector)
    model = LlamaConfig(
        vocab_size=8,
        hidden_size=head_dim,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=head_dim,
    )
    batching = ContinuousBatchingConfig(
        page_size=spec.block_size,
        num_blocks=spec.num_blocks,
        max_batch_tokens=64,
        max_memory_percent=0.5,
        max_blocks_per_request=0,
        allow_block_sharing=allow_block_sharing,
    )
    cache = PagedAttentionCache(
        model, batching, device="cpu", distributed_helper=DistributedHelper(None, None), dtype=dtype
    )
    allocator = cache.cache_allocators["full_attention"]
    if allocator.num_blocks != spec.num_blocks or allocator.blocks_per_sector != blocks_per_sector:
        raise ValueError(
            f"transformers built {allocator.num_blocks} blocks, {allocator.blocks_per_sector} per sector; "
            f"asked for {spec.num_blocks}, {blocks_per_sector} per sector"
        )
    return cache
