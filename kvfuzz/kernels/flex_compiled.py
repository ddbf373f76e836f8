"""FlexAttention compiled by ``torch.compile`` (Inductor's Triton flex kernels), CUDA only: ``--kernel flex-compiled``.

It reads the pools exactly as the eager ``flex`` kernel does, through the same block mask
(:func:`kvfuzz.kernels.flex.block_mask_for`): the difference under test is the compiled kernel, which visits only the
blocks the mask lists and evaluates the mask_mod inside them, where the eager kernel evaluates it everywhere. One
compiled function serves every kernel made in the process; shapes that change recompile it (kvfuzz's row counts
vary, so a run's first steps compile several times: its steps/s include that, as the GPU check's figures say).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Callable

import torch
from torch.nn.attention.flex_attention import flex_attention

from kvfuzz.kernels.base import KernelUnavailable, PagedBatch, Tolerance, different_kernel_tolerance
from kvfuzz.kernels.flex import flex_over_pools
from kvfuzz.reference.content import ModelShape


@functools.cache
def compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """``flex_attention`` compiled once per process."""
    return torch.compile(flex_attention)  # type: ignore[return-value]


class FlexCompiledKernel:
    """Compiled FlexAttention over the paged pools; held to
    :data:`~kvfuzz.kernels.base.DIFFERENT_KERNEL_TOLERANCE`, provisionally until measured on a GPU (docs/kernels.md)."""

    name = "flex-compiled"

    def __init__(self, shape: ModelShape) -> None:
        if torch.device(shape.device).type != "cuda":
            raise KernelUnavailable(
                "--kernel flex-compiled runs on CUDA only (torch.compile's flex kernels are Triton's): use --device "
                "cuda, or --kernel flex on CPU"
            )
        if importlib.util.find_spec("triton") is None:
            raise KernelUnavailable("--kernel flex-compiled needs the triton package, which torch.compile generates")

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        return different_kernel_tolerance(dtype)

    def attend(self, batch: PagedBatch) -> torch.Tensor:
        return flex_over_pools(compiled_flex_attention(), batch)
