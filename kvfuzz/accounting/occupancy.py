"""The live occupancy of a device pool: what its referenced blocks hold, what sharing saves, what sits cached.

kvfuzz measures it after every step of any run (the fuzzing machine, a workload replay) from the block tables the
allocator returned, plus the allocator's own free and cached sets where it exposes them.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import attrs

from kvfuzz.allocator.types import NULL_BLOCK
from kvfuzz.text import plural

SERIES_LIMIT = 4096
"""The most samples an :class:`OccupancyLog` keeps; past it the log keeps every other sample and doubles its stride."""


@attrs.frozen
class Occupancy:
    """The device pool after one step. Blocks are physical blocks; positions are token slots.

    Identities: ``referenced_blocks · block_size = effective_positions + tail_waste_positions`` (``block_size``: the
    slots of one physical block; under KV-cache groups of different block sizes, the largest, and a block a smaller
    group holds counts its unused slots as waste);
    ``logical_blocks − referenced_blocks = saved_by_sharing ≥ 0``; with introspection,
    ``referenced + cached + free + pending = num_blocks``. ``table_entries`` counts block-table entries (one table per
    sequence, shared by all layers; one per KV-cache group under ``kv_groups``); ``cached_blocks``, ``free_blocks``
    and ``pending_blocks`` are None when the allocator does not expose them.
    """

    step: int
    num_blocks: int
    block_size: int
    sequences: int
    referenced_blocks: int
    logical_blocks: int
    effective_positions: int
    table_entries: int
    cached_blocks: Optional[int] = None
    free_blocks: Optional[int] = None
    pending_blocks: Optional[int] = None

    @property
    def tail_waste_positions(self) -> int:
        """Slots of referenced blocks that hold no token of any sequence using the block."""
        return self.referenced_blocks * self.block_size - self.effective_positions

    @property
    def saved_by_sharing(self) -> int:
        """Blocks that sharing (prefix cache, fork) saves: logical blocks mapped minus physical blocks used."""
        return self.logical_blocks - self.referenced_blocks

    FIELDS = (
        "step",
        "sequences",
        "referenced_blocks",
        "effective_positions",
        "tail_waste_positions",
        "logical_blocks",
        "saved_by_sharing",
        "cached_blocks",
        "free_blocks",
        "pending_blocks",
        "table_entries",
    )

    def row(self) -> list[Optional[int]]:
        return [getattr(self, name) for name in self.FIELDS]

    def to_json(self) -> dict:
        return dict(zip(self.FIELDS, self.row()))


def measure(
    step: int,
    tables: Iterable[tuple[Iterable[int], int]],
    block_size: int,
    num_blocks: int,
    cached_blocks: Optional[int] = None,
    free_blocks: Optional[int] = None,
    pending_blocks: Optional[int] = None,
    table_block_sizes: Optional[Sequence[int]] = None,
) -> Occupancy:
    """Occupancy from (block table, token count) pairs of the sequences holding device blocks.

    A physical block shared by several sequences counts once; its filled slots are the most any of its users has
    written into it (shared blocks hold the same prefix, so the fills nest). ``table_block_sizes``, under KV-cache
    groups of different block sizes: the tokens one block holds in each table, in order (``block_size`` is then the
    slots of a physical block, the largest of them).
    """
    fill: dict[int, int] = {}
    logical = entries = sequences = 0
    for number, (table, length) in enumerate(tables):
        sequences += 1
        size = block_size if table_block_sizes is None else table_block_sizes[number]
        for index, block in enumerate(table):
            entries += 1
            if block == NULL_BLOCK:
                continue
            logical += 1
            used = max(0, min(size, length - index * size))
            if used > fill.get(block, -1):
                fill[block] = used
    return Occupancy(
        step,
        num_blocks,
        block_size,
        sequences,
        len(fill),
        logical,
        sum(fill.values()),
        entries,
        cached_blocks,
        free_blocks,
        pending_blocks,
    )


@attrs.frozen
class OccupancySummary:
    """A run's occupancy: the peak sample (most referenced blocks, first reached), the mean of every field over all
    ``samples`` steps, and the series of every ``stride``-th sample."""

    samples: int
    peak: Optional[Occupancy]
    mean: dict
    stride: int
    series: tuple

    def to_json(self) -> dict:
        return {
            "samples": self.samples,
            "peak": self.peak.to_json() if self.peak is not None else None,
            "mean": self.mean,
            "series": {
                "stride": self.stride,
                "columns": list(Occupancy.FIELDS),
                "rows": [sample.row() for sample in self.series],
            },
        }

    def describe(self) -> list[str]:
        """Peak and mean, one line each, for a person."""
        if self.peak is None:
            return ["occupancy: no step ran"]
        peak, mean = self.peak, self.mean
        cached = "" if peak.cached_blocks is None else f", {peak.cached_blocks} cached-but-free"
        lines = [
            f"occupancy over {self.samples} steps (pool of {peak.num_blocks} blocks x {peak.block_size} slots):",
            f"  peak: {peak.referenced_blocks} blocks referenced by {plural(peak.sequences, 'sequence')}: "
            f"{peak.effective_positions} positions of K/V, {peak.tail_waste_positions} tail waste, "
            f"{peak.saved_by_sharing} blocks saved by sharing{cached}; {peak.table_entries} block-table entries",
        ]
        if mean:
            cached = "" if "cached_blocks" not in mean else f", {mean['cached_blocks']:.1f} cached-but-free"
            lines.append(
                f"  mean: {mean['referenced_blocks']:.1f} blocks referenced: "
                f"{mean['effective_positions']:.1f} positions of K/V, {mean['tail_waste_positions']:.1f} tail "
                f"waste, {mean['saved_by_sharing']:.1f} blocks saved by sharing{cached}"
            )
        return lines


@attrs.define
class OccupancyLog:
    """Collects occupancy samples: the peak, running totals of every field, and a series thinned to at most
    :data:`SERIES_LIMIT` samples (every ``stride``-th step)."""

    samples: int = 0
    peak: Optional[Occupancy] = None
    totals: dict = attrs.field(factory=dict)
    series: list = attrs.field(factory=list)
    stride: int = 1

    def record(self, occupancy: Occupancy) -> None:
        if self.samples % self.stride == 0:
            self.series.append(occupancy)
            if len(self.series) > SERIES_LIMIT:
                self.series = self.series[::2]
                self.stride *= 2
        self.samples += 1
        if self.peak is None or occupancy.referenced_blocks > self.peak.referenced_blocks:
            self.peak = occupancy
        for name, value in occupancy.to_json().items():
            if value is not None and name != "step":
                self.totals[name] = self.totals.get(name, 0) + value

    def summary(self) -> OccupancySummary:
        mean = {name: round(total / self.samples, 3) for name, total in self.totals.items()}
        return OccupancySummary(self.samples, self.peak, mean, self.stride, tuple(self.series))
