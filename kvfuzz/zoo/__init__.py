"""The zoo: broken allocators, each one realistic slip away from kvfuzz's correct allocator, with the invariant
kvfuzz must name when it catches it. Each module registers its own slips (its ``VARIANTS``, beside their classes);
this package collects them in a fixed order.
"""

from __future__ import annotations

from kvfuzz.zoo import cache_keys, contract, deep, deferred_free, eviction, host_pool, hybrid, lookahead, variants
from kvfuzz.zoo.entry import Variant, ZooAllocator

__all__ = ["VARIANTS", "Variant", "ZooAllocator", "variant"]

VARIANTS: tuple[Variant, ...] = (
    *variants.VARIANTS,
    *deferred_free.VARIANTS,
    *host_pool.VARIANTS,
    *cache_keys.VARIANTS,
    *deep.VARIANTS,
    *contract.VARIANTS,
    *lookahead.VARIANTS,
    *eviction.VARIANTS,
    *hybrid.VARIANTS,
)
"""Every slip of the zoo, module by module in this order (the order of ``kvfuzz zoo``'s table and docs/zoo.md)."""


def variant(name: str) -> Variant:
    for candidate in VARIANTS:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no zoo variant named {name!r}; known: {', '.join(v.name for v in VARIANTS)}")
