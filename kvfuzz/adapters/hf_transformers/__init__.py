"""HF transformers' continuous-batching paged cache (``transformers.generation.continuous_batching``) under kvfuzz.

Factories, for ``kvfuzz run --allocator kvfuzz.adapters.hf_transformers:<factory>``:

* ``paged_attention_cache``: block sharing on (prefix matching, de-duplication of completed blocks);
* ``paged_attention_cache_no_sharing``: ``allow_block_sharing=False``;
* ``paged_attention_cache_two_block_sectors``: sharing on, and cache sectors of two blocks, so that the cache pool's
  sector bookkeeping (partly used sectors, sectors handed back when all their blocks are free) is exercised too.

transformers is imported only when a factory is called.
"""

from __future__ import annotations

from kvfuzz.adapters.hf_transformers.adapter import TransformersPagedCache
from kvfuzz.adapters.hf_transformers.build import paged_attention_cache as _build
from kvfuzz.allocator.types import PoolSpec

CODE_UNDER_TEST = ("transformers", ("generation/continuous_batching",))
"""What a campaign's --coverage measures of this adapter's allocator: transformers' continuous-batching paged cache
(kvfuzz.coverage.scope)."""

__all__ = [
    "TransformersPagedCache",
    "paged_attention_cache",
    "paged_attention_cache_no_sharing",
    "paged_attention_cache_two_block_sectors",
]


def paged_attention_cache(spec: PoolSpec) -> TransformersPagedCache:
    """A ``PagedAttentionCache`` with block sharing, one block per sector."""
    return TransformersPagedCache(_build(spec, allow_block_sharing=True))


def paged_attention_cache_no_sharing(spec: PoolSpec) -> TransformersPagedCache:
    """A ``PagedAttentionCache`` with ``allow_block_sharing=False``: no prefix matching, nothing cached."""
    return TransformersPagedCache(_build(spec, allow_block_sharing=False))


def paged_attention_cache_two_block_sectors(spec: PoolSpec) -> TransformersPagedCache:
    """A ``PagedAttentionCache`` with block sharing whose sectors hold two blocks each."""
    return TransformersPagedCache(_build(spec, allow_block_sharing=True, blocks_per_sector=2))
