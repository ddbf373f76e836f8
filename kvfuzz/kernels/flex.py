"""The FlexAttention kernel: :func:`torch.nn.attention.flex_attention.flex_attention` reading the paged pools in
place, steered by a :class:`~torch.nn.attention.flex_attention.BlockMask` built from the block tables.

The pools ``[num_blocks * block_size, L, Hkv, D]`` are viewed (not copied) as one key/value sequence of
``num_blocks * block_size`` physical slots with ``L * Hkv`` heads; each running sequence is one batch row with one
query (its last token) over ``L * Hq`` heads, and ``enable_gqa`` maps query head ``l * Hq + j`` to KV head
``l * Hkv + j // (Hq / Hkv)``, the reference's grouping. The mask_mod maps a physical slot to its logical position
through a ``[S, num_blocks]`` physical -> logical map built from the tables, and admits it only inside
``[start, length)``: causal for the last token, and the sliding window's start. The block mask lists, per row, the
physical blocks the table names there (what a compiled kernel would visit).

It runs eagerly, never compiled: compiling costs tens of seconds per new shape, and kvfuzz's shapes change every
step. Even uncompiled, ``flex_attention`` traces each call with Dynamo (seconds on first use and on every new shape);
its debug switch runs the same math as plain torch ops instead.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn.attention.flex_attention as flex_module
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kvfuzz.allocator.types import NULL_BLOCK
from kvfuzz.kernels.base import PagedBatch, Tolerance, different_kernel_tolerance


@contextlib.contextmanager
def eager_flex_attention() -> Iterator[None]:
    """Run :func:`flex_attention` as plain eager torch ops (its documented debug switch), not through Dynamo."""
    saved = flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        yield
    finally:
        flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = saved


def pool_as_heads(pool: torch.Tensor) -> torch.Tensor:
    """``[slots, L, H, D]`` -> ``[1, L * H, slots, D]``, a view of the same storage."""
    slots, layers, heads, dim = pool.shape
    return pool.permute(1, 2, 0, 3).reshape(1, layers * heads, slots, dim)


_ABSENT = -(1 << 40)
"""The offset of a physical block a row's table does not name: far below any position, so never admitted."""


def block_mask_for(batch: PagedBatch) -> BlockMask:
    """The block mask of ``batch``: the blocks each row's table names in its window, and the mask_mod that maps a
    physical slot back to its logical position.

    ``offset[b, block]`` is the first logical position of physical ``block`` in row ``b``'s table, minus the row's
    window start (:data:`_ABSENT` where the table does not name the block); slot ``kv`` is read iff its position
    relative to the start, ``offset[b, kv // size] + kv % size``, lies in ``[0, length - start)``: causal for the
    last token and inside the sliding window (and, where row b's KV-cache group holds fewer tokens per block than
    the pools have rows, ``kv % size`` is below that count). Two lookups per slot: eager flex evaluates the mask_mod
    under four nested vmaps, whose cost grows with every op.
    """
    device, size, num_blocks = batch.keys.device, batch.block_size, batch.num_blocks
    rows = len(batch.seqs)
    offset = torch.full((rows, num_blocks), _ABSENT, dtype=torch.int64)
    kv_indices = torch.zeros((rows, 1, 1, num_blocks), dtype=torch.int32)
    kv_num_blocks = torch.zeros((rows, 1, 1), dtype=torch.int32)
    for row, table in enumerate(batch.tables):
        tokens = batch.tokens_per_block(row)
        for index, block in enumerate(table):
            if block != NULL_BLOCK:
                offset[row, block] = index * tokens - batch.starts[row]
        read = [block for block in table[batch.starts[row] // tokens :] if block != NULL_BLOCK]
        kv_indices[row, 0, 0, : len(read)] = torch.tensor(read, dtype=torch.int32)
        kv_num_blocks[row] = len(read)
    offset = offset.to(device)
    spans = torch.tensor([length - start for start, length in zip(batch.starts, batch.lengths)], device=device)

    if batch.block_sizes and any(tokens != size for tokens in batch.block_sizes):
        # A group whose blocks hold fewer tokens than the pools' rows uses the first ``tokens`` rows of each.
        held = torch.tensor(batch.block_sizes, device=device)

        def physical_mask(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            within = kv_idx % size
            relative = offset[b, kv_idx // size] + within
            return (within < held[b]) & (relative >= 0) & (relative < spans[b])

    else:

        def physical_mask(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            relative = offset[b, kv_idx // size] + kv_idx % size
            return (relative >= 0) & (relative < spans[b])

    return BlockMask.from_kv_blocks(
        kv_num_blocks.to(device),
        kv_indices.to(device),
        BLOCK_SIZE=(1, size),
        mask_mod=physical_mask,
        seq_lengths=(1, num_blocks * size),
    )


class FlexKernel:
    """FlexAttention over the paged pools, eager; held to :data:`~kvfuzz.kernels.base.DIFFERENT_KERNEL_TOLERANCE`."""

    name = "flex"

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        return different_kernel_tolerance(dtype)

    def attend(self, batch: PagedBatch) -> torch.Tensor:
        with eager_flex_attention():
            return flex_over_pools(flex_attention, batch)


def flex_over_pools(function: Callable[..., torch.Tensor], batch: PagedBatch) -> torch.Tensor:
    """``function`` (flex_attention, eager or compiled) over the paged pools of ``batch`` through its block mask: each
    row one query over ``L * Hq`` heads, ``[S, L, Hq, D]`` back."""
    rows, layers, query_heads, dim = batch.queries.shape
    queries = batch.queries.reshape(rows, layers * query_heads, 1, dim)
    out = function(
        queries,
        pool_as_heads(batch.keys),
        pool_as_heads(batch.values),
        block_mask=block_mask_for(batch),
        enable_gqa=True,
    )
    return out.reshape(rows, layers, query_heads, dim)
