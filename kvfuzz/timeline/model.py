"""The timeline of one replayed trace, as immutable records: what the page and the picture draw.

Columns are the program's calls (a column for the teardown when the failure happened there), in order; lanes are
physical blocks (device blocks, and host blocks when swap is involved). ``cells[lane][column]`` is the lane's state
after the column's call; ``marks`` are the events of one call on one lane (a write, a copy, a release, a cache hit,
the failure). Nothing here is drawn: :mod:`kvfuzz.timeline.html` and :mod:`kvfuzz.timeline.png` draw it.
"""

from __future__ import annotations

from typing import Optional

import attrs

DEVICE = "device"
HOST = "host"

MARK_KINDS = {
    "hold": "a sequence's table entry takes the block (admission, growth, fork sharing, swap-in)",
    "release": "a table entry lets go of the block (free, preempt, swap-out, rollback)",
    "scheduled": "the next step will write these positions here",
    "write": "a step wrote K/V into the block",
    "cow": "copy-on-write: the block was filled by copying another block",
    "fork-copy": "fork copy: the block was filled by copying the parent's block",
    "swap-out": "swap-out: the device block was copied to this host block",
    "swap-in": "swap-in: this device block was filled from a host block",
    "pending": "released with work in flight: that work may still land until the window closes",
    "window-closed": "the in-flight window closed: no earlier work can land any more",
    "land": "late in-flight work landed on the block",
    "cached": "the block entered the allocator's cached set (unreferenced, reusable K/V)",
    "hit": "a cache hit: an admitted sequence was told these positions are already computed here",
    "evicted": "the block left the cache (evicted or reset)",
    "failure": "the failing operation, on a block the violation names",
}
"""Every kind of mark, and what it means (the page's legend)."""


@attrs.frozen
class Holding:
    """One block-table entry that references a block: ``seq``'s logical block ``index``."""

    seq: str  # the sequence
    index: int  # its logical block index

    def __str__(self) -> str:
        return f"{self.seq}/{self.index}"


@attrs.frozen
class Cell:
    """A lane's state after one call. A block with no holders, not pending and not cached is free (as kvfuzz sees
    it)."""

    holders: tuple[Holding, ...] = ()  # the table entries referencing it, sorted
    refcount: Optional[int] = None  # the allocator's own refcount (None: no introspection, or a host block)
    pending: bool = False  # released while work was in flight that may still land on it
    cached: bool = False  # in the allocator's cached set (None of kvfuzz's business otherwise)

    @property
    def state(self) -> str:
        """What the lane draws for this cell: held-pending, shared, held, pending, cached, or free."""
        if self.holders and self.pending:
            return "held-pending"
        if len(self.holders) > 1:
            return "shared"
        if self.holders:
            return "held"
        if self.pending:
            return "pending"
        return "cached" if self.cached else "free"

    def describe(self) -> str:
        parts = [f"held by {', '.join(map(str, self.holders))}" if self.holders else "unreferenced"]
        if self.refcount is not None:
            parts.append(f"refcount {self.refcount}")
        if self.pending:
            parts.append("in-flight work may still land")
        if self.cached:
            parts.append("cached")
        return "; ".join(parts)


EMPTY = Cell()


@attrs.frozen
class Lane:
    """One physical block drawn as a horizontal lane."""

    pool: str  # DEVICE or HOST
    block: int  # kvfuzz's block id (the contract's)
    library_name: Optional[str]  # the library's own id for it, where the adapter maps one ("vLLM block 4")
    in_failure: bool  # the violation names it, or the failing call acted on it

    @property
    def key(self) -> tuple[str, int]:
        return (self.pool, self.block)

    @property
    def label(self) -> str:
        return f"{'host ' if self.pool == HOST else ''}block {self.block}"


@attrs.frozen
class Mark:
    """One event of one call on one lane."""

    column: int  # index into Timeline.columns
    pool: str  # the lane's pool
    block: int  # the lane's block
    kind: str  # a key of MARK_KINDS
    text: str  # what happened, for a person
    partner: Optional[tuple[str, int]] = None  # the other lane of a copy: (pool, block) copied from or to


@attrs.frozen
class SeqTable:
    """One live sequence's block table after a call."""

    seq: str  # the sequence
    status: str  # running, swapped out or preempted
    table: tuple[int, ...]  # device blocks by logical index (-1: dropped by a sliding window)
    host_table: tuple[int, ...]  # host blocks while swapped out
    length: int  # its tokens
    written: int  # positions holding K/V (the rest are written by the next step)


@attrs.frozen
class Column:
    """One call of the program, and the block tables after it."""

    call_index: int  # its index in the program (len(program) for the teardown)
    call: str  # the call as the program prints it
    rule: str  # its operation (or "teardown")
    step: int  # the step being scheduled after it (a ``step`` call launches one and moves this on)
    tables: tuple[SeqTable, ...]  # every live sequence's table after the call


@attrs.frozen
class Outcome:
    """The failure: as recorded in the trace, and as the replay found it."""

    title: str  # the recorded title (an invariant's, or a crash's)
    invariant: Optional[int]  # the recorded invariant's number, None for a crash or a hang
    explanation: str  # the replay's explanation (the recorded one when the replay found none or did not run)
    column: Optional[int]  # the failing call's column, None when the replay did not fail
    verdict: str  # "reproduced", "failed differently", "no longer reproduces" or "not replayed"


@attrs.frozen
class Timeline:
    """One trace replayed, call by call, for drawing.

    Invariant kept: ``cells`` has one row per lane, each as long as ``columns``; every mark's column is an index
    into ``columns`` and its (pool, block) a lane's key.
    """

    source: str  # the trace file
    allocator: str  # the allocator replayed
    setting: str  # pool geometry and W, for a person
    block_size: int  # slots per block
    total_calls: int  # calls in the trace's program
    columns: tuple[Column, ...]  # the calls shown (all, or the window ending at the failure)
    lanes: tuple[Lane, ...]  # the blocks shown, device blocks first
    cells: tuple[tuple[Cell, ...], ...]  # cells[lane][column]: the lane's state after the column's call
    marks: tuple[Mark, ...]  # events, by column
    outcome: Outcome  # the failure, recorded and replayed
    notes: tuple[str, ...] = ()  # what the reader must know: a window, a replay that could not run
