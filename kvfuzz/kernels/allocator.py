"""The allocator's own kernel: an allocator that ships a paged-attention path (as torch's ``PagedAttention`` does,
through ``convert_logical_block_mask`` and FlexAttention) runs invariant 2's paged side itself, over the engine's
pools and through its own page tables, exactly as its users would call it."""

from __future__ import annotations

import torch

from kvfuzz.allocator.protocol import AllocatorProtocol, ProvidesAttention
from kvfuzz.kernels.base import KernelUnavailable, PagedBatch, Tolerance, different_kernel_tolerance


class AllocatorKernel:
    """Delegates to ``allocator.paged_attention``; held to
    :data:`~kvfuzz.kernels.base.DIFFERENT_KERNEL_TOLERANCE` (its kernel is not the reference's)."""

    name = "allocator"

    def __init__(self, allocator: AllocatorProtocol) -> None:
        if not allocator.capabilities.attention_kernel or not isinstance(allocator, ProvidesAttention):
            raise KernelUnavailable(
                f"kernel 'allocator': {type(allocator).__name__} does not provide its own "
                "attention (capabilities.attention_kernel and a paged_attention method)"
            )
        self.allocator = allocator

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        return different_kernel_tolerance(dtype)

    def attend(self, batch: PagedBatch) -> torch.Tensor:
        return self.allocator.paged_attention(
            batch.queries, batch.keys, batch.values, batch.seqs, batch.lengths, batch.starts
        )
