"""Attention kernels for invariant 2, by name: ``gather`` (the reference's own function on gathered K/V, bitwise),
``flex`` (FlexAttention over the paged pools, within a tolerance), ``allocator`` (the allocator's own
paged-attention path, where it declares one), ``vllm-triton`` and ``sglang-triton`` (vLLM's Triton unified attention
and SGLang's Triton decode and extend attention, from the installed engines; Triton's interpreter on CPU), and on
CUDA only ``flex-compiled`` (FlexAttention under torch.compile), ``flashinfer`` and ``flashinfer-prefill``
(FlashInfer's paged decode and prefill wrappers).

A kernel is made for one allocator and one model shape (its dtype and device decide its tolerance and, for the
engines' Triton kernels, whether Triton's interpreter runs them). Names are fixed here, so the command line can
list them without importing anything heavy; a kernel whose package is not installed raises
:class:`KernelUnavailable` when made, saying which package. A kernel that must set the process up before its
package is imported (Triton's interpreter is chosen by an environment variable read at import) names a preparation
in :data:`PREPARE`, which :func:`prepare_kernel` runs before the allocator, and so the engine, is loaded."""

from __future__ import annotations

import importlib
from typing import Any, Callable

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
from kvfuzz.reference.content import ModelShape

KernelFactory = Callable[[AllocatorProtocol, ModelShape], AttentionKernel]
"""Makes a kernel for a machine driving an allocator over pools of a model shape; raises KernelUnavailable."""


def _lazy(module: str) -> Any:
    """``kvfuzz.kernels.<module>``, imported when a kernel of it is first made (CUDA-only kernels stay unloaded)."""
    return importlib.import_module(f"kvfuzz.kernels.{module}")


def _prepare_vllm_triton(shape: ModelShape) -> None:
    _lazy("vllm_triton").prepare(shape)


def _prepare_sglang_triton(shape: ModelShape) -> None:
    from kvfuzz.kernels.triton_setup import interpret_on_cpu

    interpret_on_cpu("sglang-triton", shape)


KERNELS: dict[str, KernelFactory] = {
    "gather": lambda _allocator, _shape: GatherKernel(),
    "flex": lambda _allocator, _shape: FlexKernel(),
    "allocator": lambda allocator, _shape: AllocatorKernel(allocator),
    "vllm-triton": lambda _allocator, shape: _lazy("vllm_triton").VllmTritonKernel(shape),
    "sglang-triton": lambda _allocator, shape: _lazy("sglang_triton").SGLangTritonKernel(shape),
    "flex-compiled": lambda _allocator, shape: _lazy("flex_compiled").FlexCompiledKernel(shape),
    "flashinfer": lambda _allocator, shape: _lazy("flashinfer").FlashInferKernel(shape, prefill=False),
    "flashinfer-prefill": lambda _allocator, shape: _lazy("flashinfer").FlashInferKernel(shape, prefill=True),
}
KERNEL_NAMES = tuple(KERNELS)

PREPARE: dict[str, Callable[[ModelShape], None]] = {
    "vllm-triton": _prepare_vllm_triton,
    "sglang-triton": _prepare_sglang_triton,
}
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
    "Mismatch",
    "PagedBatch",
    "Tolerance",
    "compare",
    "different_kernel_tolerance",
    "make_kernel",
    "prepare_kernel",
]
