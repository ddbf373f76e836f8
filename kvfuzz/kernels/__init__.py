"""Attention kernels for invariant 2, by name: ``gather`` (the reference's own function on gathered K/V, bitwise),
``flex`` (FlexAttention over the paged pools, within a tolerance) and ``allocator`` (the allocator's own
paged-attention path, where it declares one)."""

from __future__ import annotations

from typing import Callable

from kvfuzz.allocator.protocol import AllocatorProtocol
from kvfuzz.kernels.allocator import AllocatorKernel
from kvfuzz.kernels.base import (
    AttentionKernel,
    KernelUnavailable,
    Mismatch,
    PagedBatch,
    Tolerance,
    compare,
    different_kernel_tolerance,
)
from kvfuzz.kernels.flex import FlexKernel
from kvfuzz.kernels.gather import GatherKernel

KERNELS: dict[str, Callable[[AllocatorProtocol], AttentionKernel]] = {
    "gather": lambda _allocator: GatherKernel(),
    "flex": lambda _allocator: FlexKernel(),
    "allocator": AllocatorKernel,
}
KERNEL_NAMES = tuple(KERNELS)


def make_kernel(name: str, allocator: AllocatorProtocol) -> AttentionKernel:
    """The kernel ``name`` for a machine driving ``allocator``; raises :class:`KernelUnavailable`."""
    if name not in KERNELS:
        raise KernelUnavailable(f"no attention kernel named {name!r}; choose one of {', '.join(KERNEL_NAMES)}")
    return KERNELS[name](allocator)


__all__ = [
    "AttentionKernel",
    "AllocatorKernel",
    "FlexKernel",
    "GatherKernel",
    "KERNELS",
    "KERNEL_NAMES",
    "KernelUnavailable",
    "Mismatch",
    "PagedBatch",
    "Tolerance",
    "compare",
    "different_kernel_tolerance",
    "make_kernel",
]
