"""Copies an allocator may undo (``dedupes_copied_tail``, ``remaps_on_step``): a grow's copy-on-write copy dropped
because the table maps a block holding the same K/V, and blocks swapped for identical ones when a step completes.
Forks and copy-on-write themselves are the engine's core operations.
"""

from __future__ import annotations

from typing import Sequence

from kvfuzz.allocator.types import BlockCopy, SeqId
from kvfuzz.engine.core import EngineCore
from kvfuzz.engine.events import Completion
from kvfuzz.engine.expected import Status


class TailDeduplication:
    """Under ``dedupes_copied_tail``: a grow's copies into blocks its table does not map are wasted work, checked
    and released."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core  # the engine this feature is part of

    def deduplicated(
        self, seq: SeqId, copies: Sequence[BlockCopy], old_table: tuple[int, ...], old_len: int
    ) -> list[BlockCopy]:
        """The copies whose destination ``seq``'s table does not map after its grow, each checked (a copy of the
        partial tail the grow filled, into a block left unreferenced and uncached, while the table maps a block
        holding the same K/V) and released as wasted work."""
        core = self.core
        table = core.expected.seqs[seq].table
        deduplicated = []
        for copy in copies:
            if copy.dst in table:
                continue
            index = core.checks.exclusive.copy_deduplicated(seq, copy, old_table, old_len)
            core.checks.content.deduplicated_tail(seq, index, copy.dst)
            core.pools.note(
                copy.dst, f"copy-on-write destination dropped by {seq}'s grow, its table mapping block {table[index]}"
            )
            core.pools.release(copy.dst, seq)
            deduplicated.append(copy)
            core.stats["copy-on-write copies deduplicated"] += 1
        return deduplicated


class StepRemaps:
    """Under ``remaps_on_step``: the allocator may swap a running sequence's block for one holding the same K/V when
    a step completes (de-duplication)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core  # the engine this feature is part of

    def completed(self, completion: Completion) -> None:
        """Every new table is adopted, then every written position that moved is checked bit for bit, with refcounts
        and the free set."""
        core = self.core
        touched: set[int] = set()
        positions: list[tuple[SeqId, int]] = []
        for seq in core.expected.ids(Status.RUNNING):
            model, size = core.expected.seqs[seq], core.expected.layout(seq).size
            table = core.table(seq)
            if table == model.table:
                continue
            moved = [index for index, (old, new) in enumerate(zip(model.table, table)) if old != new]
            touched |= core.set_table(seq, table, "remapped at step completion for", reuses_cached=True).touched
            core.stats["remapped blocks"] += len(moved)
            positions += [
                (seq, p) for index in moved for p in range(index * size, min((index + 1) * size, model.written))
            ]
        if touched:
            core.checks.content.holds(core.pools.take_dirty(), positions)
            core.checks.accounting.touched(touched)
