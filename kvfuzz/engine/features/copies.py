"""Copies an allocator may undo (``dedupes_copied_tail``, ``remaps_on_step``): a grow's copy-on-write copy dropped
because the table maps a block holding the same K/V, and blocks swapped for identical ones when a step completes.
Forks and copy-on-write themselves are the engine's core operations. The checks of a dropped copy (invariants 5 and
1) are the feature's own: only a deduplicated copy triggers them.
"""

from __future__ import annotations

from typing import Optional, Sequence

from kvfuzz.allocator.types import BlockCopy, SeqId
from kvfuzz.engine.checks import CheckContext, Checks
from kvfuzz.engine.checks.explain import found, prefix, where
from kvfuzz.engine.core import EngineCore
from kvfuzz.engine.events import Completion
from kvfuzz.engine.expected import Status
from kvfuzz.engine.violations import Cause, Invariant


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
            index = check_copy_deduplicated(core.checks.context, seq, copy, old_table, old_len)
            check_deduplicated_tail(core.checks, seq, index, copy.dst)
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


def check_copy_deduplicated(
    context: CheckContext, seq: str, copy: BlockCopy, old_table: tuple[int, ...], old_len: int
) -> int:
    """Invariant 5 for a grow's copy whose destination ``seq``'s table does not map after the grow: allowed only
    under ``dedupes_copied_tail``, as a copy of the partial tail block (logical block ``old_len // block_size``)
    that the grow filled, into a block no table references and the allocator does not list as cached (the
    table maps another block for it, whose content the caller checks). Returns that logical index."""
    h = context.state
    size = h.block_size
    index = old_len // size
    holders = h.refs.holders.get(copy.dst, set())
    cached = context.introspection is not None and copy.dst in context.introspection.cached_blocks()
    if not (old_len % size and index < len(old_table) and old_table[index] == copy.src):
        found = (
            f"block {copy.src} is not {seq}'s partial tail before the grow (table {list(old_table)}, {old_len} tokens)"
        )
    elif h.length(seq) < (index + 1) * size:
        found = f"the grow leaves {seq}'s logical block {index} partial ({h.length(seq)} tokens)"
    elif holders:
        found = f"block {copy.dst} is referenced by {h.entries(holders)}"
    elif cached:
        found = f"block {copy.dst} is listed as cached: the copy overwrites cached K/V"
    else:
        return index
    context.fail(
        Invariant.EXCLUSIVE_WRITES,
        f"copy-on-write copy from block {copy.src} into block {copy.dst}, which {seq}'s table does not map after "
        "the grow",
        [
            f"expected: block {copy.dst} referenced by {seq} alone, or (dedupes_copied_tail) a copy of the partial "
            "tail the grow filled, into a block left unreferenced and uncached",
            f"found:    {found}; table after the grow {list(h.seqs[seq].table)}",
            *context.pools.block_story(copy.dst),
        ],
        Cause("a copy-on-write copy into a block the grown table does not map"),
    )


def check_deduplicated_tail(checks: Checks, seq: str, index: int, dst: int) -> None:
    """Invariant 1 under ``dedupes_copied_tail``: the block ``seq``'s table maps at logical block ``index`` in
    place of the copy into ``dst`` holds every written position of it (bit for bit), or, under
    ``hits_scheduled_writes``, the next step writes it there before anything reads it."""
    context = checks.context
    h = context.state
    size = h.block_size
    block = h.seqs[seq].table[index]
    tags = h.reference.tags(seq)
    present: list[tuple[str, int]] = []
    scheduled: Optional[dict[int, int]] = None  # the next step's writes, gathered once if needed
    for position in range(index * size, min((index + 1) * size, h.seqs[seq].written)):
        slot = block * size + position % size
        record = context.pools.record(slot)
        if record is not None and record.tag == tags[position]:
            present.append((seq, position))
            continue
        if h.caps.hits_scheduled_writes:
            scheduled = h.scheduled_tags() if scheduled is None else scheduled
            if scheduled.get(slot) == tags[position]:
                continue
        context.fail(
            Invariant.CONTENT,
            f"grow of {seq} maps its logical block {index} to block {block} in place of its copy into block "
            f"{dst}, but {where(h, seq, position)} holds another prefix's K/V",
            [
                f"expected: K/V of {prefix(h, seq, position)} (dedupes_copied_tail: a block holding the same K/V)",
                f"found:    {found(record)}",
                *context.pools.block_story(block),
            ],
            Cause("a deduplicated tail block without the K/V of the copy it replaces"),
        )
    checks.content.holds((), present)
