"""Where a table's positions live in the engine's K/V pools: the one place that turns (table, position) into a
pool slot.

The pools give every physical block ``rows`` rows (slots): the largest block size of any KV-cache group, or the
pool's ``block_size`` without groups. A table whose group holds ``size`` tokens per block uses the first ``size``
rows of each block it maps, so position p of that table lives at row ``table[p // size] * rows + p % size``, and a
slot s is offset ``s % rows`` of block ``s // rows``. Without groups of different block sizes ``size == rows`` and
this is the plain paged layout ``table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from typing import Sequence

import attrs


def _at_least_one(_instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


@attrs.frozen
class TableLayout:
    """The pool layout of one table. Invariant kept: ``1 <= size <= rows``."""

    size: int = attrs.field(validator=_at_least_one)  # tokens one block holds in this table's group
    rows: int = attrs.field(validator=_at_least_one)  # rows every physical block has in the pools (the slot stride)

    def __attrs_post_init__(self) -> None:
        if self.size > self.rows:
            raise ValueError(f"a block of {self.rows} rows cannot hold {self.size} tokens")

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks ``num_tokens`` tokens fill in this table."""
        return -(-num_tokens // self.size)

    def index(self, position: int) -> int:
        """The logical block that holds ``position``."""
        return position // self.size

    def first_position(self, index: int) -> int:
        """The first position logical block ``index`` holds."""
        return index * self.size

    def slot(self, block: int, offset: int) -> int:
        """The pool row of ``offset`` inside physical ``block``."""
        return block * self.rows + offset

    def slot_of(self, table: Sequence[int], position: int) -> int:
        """The pool row that holds ``position`` through ``table`` (whose entry for it must not be NULL_BLOCK)."""
        return table[position // self.size] * self.rows + position % self.size

    def block_of(self, slot: int) -> int:
        """The physical block of pool row ``slot``."""
        return slot // self.rows

    def offset_of(self, slot: int) -> int:
        """The offset of pool row ``slot`` inside its physical block."""
        return slot % self.rows
