"""Allocators carrying more than one of the zoo's bugs, for campaigns: a shallow bug that fires in almost every
run must not hide a deeper one behind it.

``shallow_and_deep`` carries :class:`~kvfuzz.zoo.variants.NoCopyOnWrite` (a fork followed by a grow: found in the
first examples) and :class:`~kvfuzz.zoo.variants.SwapInWrongHostBlock` (a sequence of two or more blocks swapped
out and back in, then read: rarer). A campaign against it must report both; the traces it saves each replay against
the one variant whose bug they show.
"""

from __future__ import annotations

from kvfuzz.allocator.paged import PagedAllocator
from kvfuzz.allocator.types import PoolSpec
from kvfuzz.zoo.variants import NoCopyOnWrite, SwapInWrongHostBlock


class ShallowAndDeep(NoCopyOnWrite, SwapInWrongHostBlock):
    """Copy-on-write missing (NoCopyOnWrite) and swap-in mapping the wrong host blocks (SwapInWrongHostBlock)."""


def shallow_and_deep(spec: PoolSpec) -> PagedAllocator:
    """``kvfuzz.zoo.combined:shallow_and_deep``: both bugs, W = 1 like the zoo's variants."""
    return ShallowAndDeep(spec.block_size, spec.num_blocks, spec.num_host_blocks, inflight_window=1)
