"""Exact position and byte arithmetic of paged allocation against a fixed per-sequence reservation.

For a sequence of n tokens, block size B, L layers, h_kv KV heads, head dim d_h and b bytes per scalar:

* K/V bytes = 2·L·n·h_kv·d_h·b (keys and values; no block tables, workspace or padding);
* positions allocated A_B(n) = B·ceil(n/B), tail waste W_B(n) = A_B(n) − n;
* a fixed reservation of M positions allocates M and wastes M − n;
* position utilisation U = Σn / Σ A — a ratio of positions, not device utilisation or throughput.

Every figure is an integer (or an exact fraction), so a worked example comes out exactly.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Iterable, Optional, Sequence

import attrs


class ReservationTooSmall(ValueError):
    """A fixed reservation shorter than some sequence: that sequence would not fit at all."""


def _positive(_instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


@attrs.frozen
class KVShape:
    """The model dimensions that turn positions into K/V bytes."""

    num_layers: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    bytes_per_scalar: int = attrs.field(validator=_positive)

    def kv_bytes(self, positions: int) -> int:
        """2·L·n·h_kv·d_h·b: the keys and values of ``positions`` positions, all layers."""
        return 2 * self.num_layers * positions * self.num_kv_heads * self.head_dim * self.bytes_per_scalar

    def describe(self) -> str:
        return (
            f"{self.num_layers} layers x {self.num_kv_heads} KV heads x head dim {self.head_dim} x "
            f"{self.bytes_per_scalar} bytes = {self.kv_bytes(1)} K/V bytes per position"
        )


def allocated_positions(length: int, block_size: int) -> int:
    """A_B(n) = B·ceil(n/B): the positions paging allocates for ``length`` tokens."""
    return block_size * -(-length // block_size)


def tail_waste(length: int, block_size: int) -> int:
    """W_B(n) = A_B(n) − n: the unused slots of the last block."""
    return allocated_positions(length, block_size) - length


@attrs.frozen
class Layout:
    """How one scheme lays out a set of sequences. ``allocated_positions = valid_positions + tail_waste`` always.

    ``block_size`` is None for the fixed reservation (``reservation`` positions per sequence), which keeps no block
    table. Block-table bytes are ``table_entries · table_entry_bytes``, one table per sequence shared by all layers.
    """

    label: str
    block_size: Optional[int]
    reservation: Optional[int]
    sequences: int
    valid_positions: int
    allocated_positions: int
    table_entries: int
    table_entry_bytes: int
    shape: KVShape

    @property
    def tail_waste(self) -> int:
        return self.allocated_positions - self.valid_positions

    @property
    def utilisation(self) -> Fraction:
        """Σn / Σ allocated, exactly."""
        return Fraction(self.valid_positions, self.allocated_positions) if self.allocated_positions else Fraction(1)

    @property
    def valid_kv_bytes(self) -> int:
        return self.shape.kv_bytes(self.valid_positions)

    @property
    def allocated_kv_bytes(self) -> int:
        return self.shape.kv_bytes(self.allocated_positions)

    @property
    def table_bytes(self) -> int:
        return self.table_entries * self.table_entry_bytes

    def to_json(self) -> dict:
        return {
            "label": self.label,
            "block_size": self.block_size,
            "reservation": self.reservation,
            "sequences": self.sequences,
            "valid_positions": self.valid_positions,
            "allocated_positions": self.allocated_positions,
            "tail_waste": self.tail_waste,
            "utilisation": float(self.utilisation),
            "valid_kv_bytes": self.valid_kv_bytes,
            "allocated_kv_bytes": self.allocated_kv_bytes,
            "table_entries": self.table_entries,
            "table_entry_bytes": self.table_entry_bytes,
            "table_bytes": self.table_bytes,
        }


def _checked(lengths: Iterable[int]) -> list[int]:
    lengths = list(lengths)
    bad = [length for length in lengths if not isinstance(length, int) or length < 0]
    if bad:
        raise ValueError(f"sequence lengths must be integers >= 0; found {bad[:5]}")
    return lengths


def paged_layout(lengths: Iterable[int], block_size: int, shape: KVShape, table_entry_bytes: int = 4) -> Layout:
    """Paging with blocks of ``block_size`` positions: each sequence gets ceil(n/B) blocks."""
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    lengths = _checked(lengths)
    entries = sum(-(-length // block_size) for length in lengths)
    return Layout(
        f"paged B={block_size}",
        block_size,
        None,
        len(lengths),
        sum(lengths),
        entries * block_size,
        entries,
        table_entry_bytes,
        shape,
    )


def reserved_layout(lengths: Iterable[int], reservation: int, shape: KVShape) -> Layout:
    """A fixed reservation of ``reservation`` positions per sequence, with no block table."""
    lengths = _checked(lengths)
    too_long = [length for length in lengths if length > reservation]
    if too_long:
        raise ReservationTooSmall(
            f"a reservation of {reservation} positions cannot hold sequences of "
            f"{sorted(too_long)[-1]} tokens ({len(too_long)} sequence(s) longer than it)"
        )
    return Layout(
        f"reserve {reservation}", None, reservation, len(lengths), sum(lengths), reservation * len(lengths), 0, 0, shape
    )


def account(
    lengths: Sequence[int],
    block_sizes: Iterable[int],
    shape: KVShape,
    reservation: Optional[int] = None,
    table_entry_bytes: int = 4,
) -> list[Layout]:
    """The reservation baseline (when given; default: the longest sequence) and one paged layout per block size."""
    lengths = _checked(lengths)
    if reservation is None:
        reservation = max(lengths, default=0)
    return [reserved_layout(lengths, reservation, shape)] + [
        paged_layout(lengths, size, shape, table_entry_bytes) for size in block_sizes
    ]
