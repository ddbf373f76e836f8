"""Attention kernels for invariant 2, by name: ``gather`` (the reference's own function on gathered K/V, bitwise),
``flex`` (FlexAttention over the paged pools, within a tolerance), ``allocator`` (the allocator's own
paged-attention path, where it declares one) and ``vllm-triton`` (vLLM's Triton unified attention, from the
installed vLLM package; Triton's interpreter on CPU).

A kernel is made for one allocator and one model shape (its dtype and device decide its tolerance and, for the
engines' Triton kernels, whether Triton's interpreter runs them). Names are fixed here, so the command line can
list them without importing anything heavy; a kernel whose package is not installed raises
:class:`KernelUnavailable` when made, saying which package. A kernel that must set the process up before its
package is imported (Triton's interpreter is chosen by an environment variable read at import) names a preparation
in :data:`PREPARE`, which :func:`prepare_kernel` runs before the allocator, and so the engine, is loaded."""

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
from kvfuzz.kernels.vllm_triton import VllmTritonKernel
from kvfuzz.kernels.vllm_triton import prepare as prepare_vllm_triton
from kvfuzz.reference.content import ModelShape

KernelFactory = Callable[[AllocatorProtocol, ModelShape], AttentionKernel]
"""Makes a kernel for a machine driving an allocator over pools of a model shape; raises KernelUnavailable."""

KERNELS: dict[str, KernelFactory] = {
    "gather": lambda _allocator, _shape: GatherKernel(),
    "flex": lambda _allocator, _shape: FlexKernel(),
    "allocator": lambda allocator, _shape: AllocatorKernel(allocator),
    "vllm-triton": lambda _allocator, shape: VllmTritonKernel(shape),  # imports vLLM and Triton only when made
}
KERNEL_NAMES = tuple(KERNELS)

PREPARE: dict[str, Callable[[ModelShape], None]] = {"vllm-triton": prepare_vllm_triton}
"""Per kernel name, what must happen in this process before its engine's package is first imported."""


def prepare_kernel(name: str, shape: ModelShape) -> None:
    """Set the process up for kernel ``name`` over pools of ``shape``: call before the allocator is loaded (a
    no-op for kernels that need nothing, and for unknown names, which :func:`make_kernel` refuses)."""
    if name in PREPARE:
        PREPARE[name](shape)


def make_kernel(name: str, allocator: AllocatorProtocol, shape: ModelShape) -> AttentionKernel:
    """The kernel ``name`` for a machine driving ``allocator`` over pools of ``shape``; raises
    :class:`KernelUnavailable` (with the reason in one line) when it cannot run here."""
    if name not in KERNELS:
        raise KernelUnavailable(f"no attention kernel named {name!r}; choose one of {', '.join(KERNEL_NAMES)}")
    return KERNELS[name](allocator, shape)


__all__ = [
    "AttentionKernel",
    "AllocatorKernel",
    "FlexKernel",
    "GatherKernel",
    "KERNELS",
    "KERNEL_NAMES",
    "KernelFactory",
    "PREPARE",
    "KernelUnavailable",
    "VllmTritonKernel",
    "Mismatch",
    "PagedBatch",
    "Tolerance",
    "compare",
    "different_kernel_tolerance",
    "make_kernel",
    "prepare_kernel",
]
