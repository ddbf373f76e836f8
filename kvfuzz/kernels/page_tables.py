"""FlashInfer's paged-KV page tables (its CSR layout) built from a :class:`~kvfuzz.kernels.base.PagedBatch`, in plain
Python so they can be checked without CUDA or FlashInfer.

FlashInfer describes a batch of sequences over a pool of pages by three arrays: ``kv_indptr`` (``[rows + 1]``, row
``i``'s pages are ``kv_indices[kv_indptr[i] : kv_indptr[i + 1]]``), ``kv_indices`` (physical page ids, in position
order) and ``kv_last_page_len`` (``[rows]``, tokens in each row's last page, from 1 to ``page_size``). A row's
sequence, as FlashInfer sees it, is ``(pages - 1) * page_size + last_page_len`` tokens long, and its one query is
its last token; ``window_left = w`` admits only the last ``w + 1`` of them (``-1``: all).

One plan has one ``page_size`` and one ``window_left``, so the batch is split into plans by the tokens a block holds
in the row's table (a KV-cache group of smaller blocks uses the first rows of each physical block: a page of that
many tokens, the pool's block stride) and by its window. A row's pages start at the block holding its window start
(``starts[i] // page_size``): blocks before it may be ``NULL_BLOCK`` and are never listed; ``window_left`` then
trims the first listed page to the window.
"""

from __future__ import annotations

from typing import Iterable

import attrs

from kvfuzz.allocator.types import NULL_BLOCK
from kvfuzz.kernels.base import PagedBatch


def _ints(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


@attrs.frozen
class PageTables:
    """The page tables of one FlashInfer plan: the batch rows sharing one page size and one window.

    Invariants: ``len(kv_indptr) == len(rows) + 1``, ``kv_indptr[0] == 0``, ``kv_indptr[-1] == len(kv_indices)``,
    every row lists at least one page, ``1 <= kv_last_page_len[i] <= page_size``, and every listed page is a real
    block of the pool (never ``NULL_BLOCK``).
    """

    rows: tuple[int, ...] = attrs.field(converter=_ints)  # the batch rows this plan attends for, in batch order
    page_size: int  # tokens one page holds in these rows' tables
    window_left: int  # the positions before the last token each row reads (-1: all that its pages hold)
    kv_indptr: tuple[int, ...] = attrs.field(converter=_ints)  # row i's pages: kv_indices[indptr[i] : indptr[i+1]]
    kv_indices: tuple[int, ...] = attrs.field(converter=_ints)  # physical page (block) ids, in position order
    kv_last_page_len: tuple[int, ...] = attrs.field(converter=_ints)  # per row, tokens in its last page


def _window_left(start: int, length: int) -> int:
    """FlashInfer's window for a row reading positions ``start .. length - 1``: -1 when it reads from position 0."""
    return length - 1 - start if start > 0 else -1


def page_tables(batch: PagedBatch) -> tuple[PageTables, ...]:
    """The plans that cover every row of ``batch`` once, ordered by (page size, window_left).

    Raises ``ValueError`` when a row would read a ``NULL_BLOCK`` or a block outside the pool: a GPU kernel would
    read out of bounds there (invariant 12 reports such a table before attention runs)."""
    grouped: dict[tuple[int, int], list[int]] = {}
    for row in range(len(batch.seqs)):
        key = (batch.tokens_per_block(row), _window_left(batch.starts[row], batch.lengths[row]))
        grouped.setdefault(key, []).append(row)
    plans = []
    for (size, window_left), rows in sorted(grouped.items()):
        indptr, indices, last_lengths = [0], list[int](), list[int]()
        for row in rows:
            start, length = batch.starts[row], batch.lengths[row]
            first, last = start // size, (length - 1) // size
            pages = batch.tables[row][first : last + 1]
            if len(pages) != last - first + 1:
                raise ValueError(f"row {row}: its table has {len(batch.tables[row])} blocks, {length} tokens need more")
            bad = [page for page in pages if page == NULL_BLOCK or not 0 <= page < batch.num_blocks]
            if bad:
                raise ValueError(f"row {row} would read block {bad[0]}, not a block of the pool's {batch.num_blocks}")
            indices.extend(pages)
            indptr.append(len(indices))
            last_lengths.append(length - last * size)
        plans.append(PageTables(rows, size, window_left, indptr, indices, last_lengths))
    return tuple(plans)
