"""vLLM's attention metadata for a :class:`~kvfuzz.kernels.base.PagedBatch`: the inputs vLLM's Triton attention
backend hands its ``unified_attention`` kernel, built from kvfuzz's block tables. Pure torch; imports no vLLM.

One launch attends for rows that share a block size (tokens per block) and a sliding window, as vLLM launches the
kernel once per attention layer of one KV-cache group. Each row contributes one query token (its last), so
``cu_seqlens_q`` is ``0, 1, .., R``; ``seqused_k`` is each row's length; the block table is ``[R, width]`` int32,
padded with block 0 (vLLM's block tables are zero-filled and its null block is block 0), and kvfuzz's
``NULL_BLOCK`` (a block a sliding window dropped) is written as 0 too, vLLM's null block. The kernel admits key
positions ``p`` with ``query_pos - p < W`` for ``window_size = (W - 1, 0)``, so a row reading ``start .. length - 1``
with ``start > 0`` has ``W = length - start``.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from kvfuzz.allocator.types import NULL_BLOCK
from kvfuzz.kernels.base import PagedBatch

TABLE_PAD = 64
"""Block tables cover positions up to the longest row rounded up to this many (the kernel's widest tile is 32), so
a tile that runs past a row's last block reads a zero entry vLLM's way, never past the table's end."""


@attrs.frozen
class Launch:
    """One call of the kernel: which rows of the batch, and their metadata."""

    rows: tuple[int, ...]  # the batch rows this launch attends for, in batch order
    tokens_per_block: int  # the tokens one block holds in these rows' tables (the kernel's block size)
    window: Optional[int]  # the sliding window W every row reads within, None for none
    block_table: torch.Tensor  # [R, width] int32: tables, NULL_BLOCK and padding written as block 0
    seqused_k: torch.Tensor  # [R] int32: each row's length (its last token's position + 1)
    cu_seqlens_q: torch.Tensor  # [R + 1] int32: query start locations, one query token per row

    @property
    def window_size(self) -> tuple[int, int]:
        """vLLM's ``window_size`` argument: ``(W - 1, 0)`` for a causal window of W, ``(-1, -1)`` for none."""
        return (-1, -1) if self.window is None else (self.window - 1, 0)

    @property
    def max_seqlen_k(self) -> int:
        return int(self.seqused_k.max())


def row_window(batch: PagedBatch, row: int) -> Optional[int]:
    """The window row ``row`` reads within: ``length - start`` when it starts after position 0, else None."""
    start, length = batch.starts[row], batch.lengths[row]
    return length - start if start > 0 else None


def group_rows(batch: PagedBatch) -> dict[tuple[int, Optional[int]], list[int]]:
    """Rows grouped by (tokens per block, window). A row reading from position 0 joins the widest window of its
    block size that covers its whole length (it reads the same there), else the window-less group."""
    groups: dict[tuple[int, Optional[int]], list[int]] = {}
    unwindowed: list[int] = []
    for row in range(len(batch.seqs)):
        window = row_window(batch, row)
        if window is None:
            unwindowed.append(row)
        else:
            groups.setdefault((batch.tokens_per_block(row), window), []).append(row)
    for row in unwindowed:
        size, length = batch.tokens_per_block(row), batch.lengths[row]
        covering = [window for (tokens, window) in groups if tokens == size and window is not None and window >= length]
        groups.setdefault((size, max(covering) if covering else None), []).append(row)
    return {key: sorted(rows) for key, rows in groups.items()}


def launch_for(batch: PagedBatch, rows: list[int], tokens_per_block: int, window: Optional[int]) -> Launch:
    """The metadata of one launch over ``rows`` (all of ``tokens_per_block`` and ``window``)."""
    longest = max(batch.lengths[row] for row in rows)
    covered = -(-longest // TABLE_PAD) * TABLE_PAD
    width = max(-(-covered // tokens_per_block), *(len(batch.tables[row]) for row in rows))
    table = torch.zeros((len(rows), width), dtype=torch.int32)
    for index, row in enumerate(rows):
        entries = [0 if block == NULL_BLOCK else block for block in batch.tables[row]]
        table[index, : len(entries)] = torch.tensor(entries, dtype=torch.int32)
    return Launch(
        rows=tuple(rows),
        tokens_per_block=tokens_per_block,
        window=window,
        block_table=table,
        seqused_k=torch.tensor([batch.lengths[row] for row in rows], dtype=torch.int32),
        cu_seqlens_q=torch.arange(len(rows) + 1, dtype=torch.int32),
    )


def launches(batch: PagedBatch) -> list[Launch]:
    """Every launch the batch needs, together covering each row exactly once."""
    return [launch_for(batch, rows, size, window) for (size, window), rows in group_rows(batch).items()]
