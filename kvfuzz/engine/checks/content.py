"""Invariant 1, content: every written position holds its own K/V, bit for bit, and every table and slot the
allocator returns puts each position where its K/V is (the swap mappings and the rollback table are checked by their
features, :mod:`~kvfuzz.engine.features.swap` and :mod:`~kvfuzz.engine.features.rollback`)."""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from kvfuzz.allocator.types import (
    Slot,
)
from kvfuzz.engine.checks.context import Checker
from kvfuzz.engine.checks.explain import found, prefix, root_cause, where
from kvfuzz.engine.expected import ExpectedState
from kvfuzz.engine.pools import SlotWrite
from kvfuzz.engine.violations import Cause, Invariant
from kvfuzz.reference.content import kv_for_tags


def clobbered(state: ExpectedState, seq: str, slot: int, record: Optional[SlotWrite]) -> Cause:
    """Which kind of write left another prefix's K/V (or none) where ``seq`` expects its own in ``slot``: the cause
    of a content mismatch, and of an attention mismatch that reads it."""
    if record is None:
        return Cause("a position whose slot no write reached")
    holders = {holder for holder, _ in state.refs.holders.get(slot // state.rows, ()) if holder != seq}
    if record.seq in holders:
        return Cause("a write by another holder of a shared block (a block two sequences hold was written)")
    if record.via.startswith("late in-flight work"):
        return Cause("late in-flight work landed in a block handed out again")
    if record.via.startswith("loaded"):
        return Cause("a host-tier load brought another prefix's K/V")
    if record.via.startswith("copied from"):
        return Cause("a copy-on-write copy brought another prefix's K/V (stale content after a copy)")
    if record.via.startswith("swapped in"):
        return Cause("a swap-in brought another prefix's K/V")
    if record.via:
        return Cause("a write withdrawn or moved by the engine (an abort's scheduled writes) left stale K/V")
    return Cause("a write for another prefix into a block this sequence maps")


class ContentChecks(Checker):
    """Invariant 1 over the engine's pools: what the allocator returned maps each position to the slot that holds its
    own K/V."""

    def holds(self, slots: Iterable[int], positions: Iterable[tuple[str, int]] = ()) -> None:
        """Every written position mapped to one of ``slots``, and every listed position, holds its own K/V."""
        h = self.state
        wanted: dict[tuple[str, int], int] = {}
        by_block: dict[int, list[int]] = {}
        for slot in slots:
            by_block.setdefault(slot // h.rows, []).append(slot % h.rows)
        for block, offsets in by_block.items():
            for seq, index in h.refs.holders.get(block, ()):
                written, layout = h.seqs[seq].written, h.layout(seq)
                for offset in offsets:
                    position = layout.first_position(index) + offset
                    if offset < layout.size and position < written:
                        wanted[(seq, position)] = layout.slot(block, offset)
        for seq, position in positions:
            if position < h.sliding_window_start(seq):
                continue
            wanted[(seq, position)] = h.layout(seq).slot_of(h.seqs[seq].table, position)
        if not wanted:
            return
        expected_tags = []
        for (seq, position), slot in wanted.items():
            tag = h.reference.tags(seq)[position]
            record = self.pools.record(slot)
            if record is None or record.tag != tag:
                self.fail(
                    Invariant.CONTENT,
                    f"{where(self.state, seq, position)} holds another prefix's K/V",
                    [
                        f"expected: K/V of {prefix(self.state, seq, position)}",
                        f"found:    {found(record)}",
                        *root_cause(self.state, seq, position, slot, record),
                        *self.pools.block_story(slot // h.rows),
                    ],
                    clobbered(self.state, seq, slot, record),
                )
            expected_tags.append(tag)
        self._bits(list(wanted.items()), expected_tags)

    def _bits(self, entries: list[tuple[tuple[str, int], int]], tags: list[int]) -> None:
        """The pool's values equal the reference's bit for bit (the shadow records already agree), where the pools'
        tensors exist: a kernel other than the gather kernel's tag check has read them in this example. Until then
        the records are the pools' whole content (``KVPools``: the tensors are made from them when first read), so
        there are no values that could differ from what the records say."""
        if not self.pools.made:
            return
        keys, values = self.pools.rows(slot for _, slot in entries)
        want_keys, want_values = kv_for_tags(tags, self.pools.shape)
        if torch.equal(keys, want_keys) and torch.equal(values, want_values):
            return
        rows = ((keys != want_keys) | (values != want_values)).flatten(1).any(1).nonzero().flatten().tolist()
        (seq, position), slot = entries[rows[0]]
        self.fail(
            Invariant.CONTENT,
            f"{where(self.state, seq, position)}: shadow record is right but the values differ",
            [
                f"expected: K/V of {prefix(self.state, seq, position)}",
                f"found:    values that differ in {len(rows)} checked position(s); the record says "
                f"{found(self.pools.record(slot))}",
            ],
            Cause("pool values that differ from what the shadow record says was written"),
        )

    def admit_table(self, seq: str, reported: tuple[int, ...], table: tuple[int, ...]) -> None:
        """Invariant 1: the table admit returned is the one ``block_table`` reports."""
        if table != reported:
            self.fail(
                Invariant.CONTENT,
                f"admit returned block table {list(reported)} for {seq}",
                [f"found: block_table({seq!r}) says {list(table)}"],
                Cause("admit returned a block table unlike block_table's"),
            )

    def grow_slots(self, seq: str, slots: Sequence[Slot], table: tuple[int, ...], old_len: int, count: int) -> None:
        """Invariant 1: grow returned one slot per token, each where the block table puts that position."""
        size = self.state.layout(seq).size
        for position, slot in enumerate(slots, start=old_len):
            want = (table[position // size], position % size)
            if (slot.block, slot.offset) != want:
                self.fail(
                    Invariant.CONTENT,
                    f"grow returned slot (block {slot.block}, offset {slot.offset}) for {seq} position {position}",
                    [f"expected: (block {want[0]}, offset {want[1]}) as its block table says: {list(table)}"],
                    Cause("grow returned a slot its block table does not put there"),
                )
        if len(slots) != count:
            self.fail(
                Invariant.CONTENT,
                f"grow of {count} tokens returned {len(slots)} slots",
                cause=Cause("grow returned a slot count unlike the tokens grown"),
            )
