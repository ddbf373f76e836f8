"""KV-cache groups and sliding windows (``kv_groups``, ``refusal_drops_window``): a sequence's tables in groups 1
onwards, read back and recorded beside its own (group 0's), forked and forgotten with it; and the blocks a refused
grow may drop out of its next token's window.

A group table is a sequence of its own in the expected state (``group_seq``), so every other check holds of it as
it holds of a sequence; the checks only groups need are the feature's own, :class:`GroupChecks`: every group's table
read back well formed, a physical block in one group's tables at a time, and the hybrid prefix-hit rule (its window,
and a hit that ends on a block boundary of every group). The check that a refused grow only dropped blocks out of the
window (invariant 7) is :class:`WindowDrops`'s own.
"""

from __future__ import annotations

import collections.abc
import math
from typing import Iterable, Optional, Sequence, cast

import attrs

from kvfuzz.allocator.errors import OutOfBlocks
from kvfuzz.allocator.protocol import GroupedTables
from kvfuzz.allocator.types import NULL_BLOCK, Namespace, SeqId, Tokens
from kvfuzz.engine.checks import CheckContext, PoolCounts
from kvfuzz.engine.checks.context import Checker
from kvfuzz.engine.checks.results import ResultChecks
from kvfuzz.engine.core import UNCHANGED, EngineCore, merged
from kvfuzz.engine.expected import SeqModel, Status, TableChange
from kvfuzz.engine.groups import group_namespace
from kvfuzz.engine.violations import Cause, Invariant


class GroupTables:
    """Under ``kv_groups``: the engine's side of a sequence's tables in groups 1 onwards."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core  # the engine this feature is part of
        self.checks = GroupChecks(core.checks.context, core.checks.results)  # the group tables' own checks

    def changed(self, change: TableChange) -> None:
        """An operation's table updates are done: a block is in one group's tables at most."""
        self.checks.one_group(change.touched)

    def admitted(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> None:
        """A new sequence's group tables get their prompt, each in its group's namespace."""
        for group, table_id in zip(self.core.caps.kv_groups[1:], self.core.expected.group_tables(seq)):
            self.core.expected.reference.add(table_id, group_namespace(namespace, group.name), tokens)

    def tables(self, seq: SeqId, table: tuple[int, ...]) -> list[tuple[SeqId, tuple[int, ...]]]:
        """(group table id, table read now) of ``seq``'s groups 1 onwards, each checked well formed and shaped as a
        table of its own (``table`` is group 0's, just read)."""
        read = list(zip(self.core.expected.group_tables(seq), self.checks.tables(seq, table)))
        for table_id, group_table in read:
            self.core.checks.results.table_shape(table_id, group_table)
        return read

    def set_tables(
        self, seq: SeqId, table: tuple[int, ...], event: str, released: str = "", hit_tokens: int = 0
    ) -> TableChange:
        """Read and record ``seq``'s tables in groups 1 onwards (``table`` is group 0's, just read)."""
        change = UNCHANGED
        for table_id, group_table in self.tables(seq, table):
            change = merged(change, self.core.set_table(table_id, group_table, event, released, hit_tokens))
        return change

    def forked(self, parent: SeqId, child: SeqId, table: tuple[int, ...], written: int) -> TableChange:
        """``child`` was forked from ``parent`` (its own table ``table``, just read): its group tables are its
        parent's, read back and checked shared."""
        state, core = self.core.expected, self.core
        for parent_id, child_id in zip(state.group_tables(parent), state.group_tables(child)):
            state.reference.fork(parent_id, child_id)
            parent_model = state.seqs[parent_id]
            state.seqs[child_id] = SeqModel(
                child_id,
                Status.RUNNING,
                written=written,
                joined_step=core.pools.next_step,
                group=parent_model.group,
                owner=child,
            )
        change = UNCHANGED
        for parent_id, child_id, group_table in zip(
            state.group_tables(parent), state.group_tables(child), self.checks.tables(child, table)
        ):
            core.checks.results.table_shape(child_id, group_table)
            filled = state.seqs[parent_id].table[: state.num_blocks_for(parent)]
            core.checks.accounting.fork_table(parent_id, child_id, filled, group_table)
            change = merged(change, core.set_table(child_id, group_table, "shared by fork with"))
        return change

    def hit(self, seq: SeqId, num_cached: int) -> None:
        """An admission's hit ends on a block boundary of every group."""
        self.checks.hit_aligned(seq, num_cached)

    def hit_window(self, table_id: SeqId, num_cached: int) -> None:
        """An admission's hit keeps every group table's window."""
        self.checks.hit_window(table_id, num_cached)


class GroupChecks(Checker):
    """Checks of the groups' tables, raised through the shared context (same operation label)."""

    def __init__(self, context: CheckContext, results: ResultChecks) -> None:
        super().__init__(context)
        self.results = results  # invariant 12, for each group's table
        self.grouped = cast(GroupedTables, context.allocator)  # the allocator's group tables

    def tables(self, seq: SeqId, group0: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Invariant 12: ``group_block_tables(seq)`` returned one sequence of int block ids per group, group 0's
        equal to ``block_table(seq)`` (``group0``); returns the tables of groups 1 onwards."""
        groups = self.state.caps.kv_groups
        found = self.grouped.group_block_tables(seq)
        names = [group.name for group in groups]
        if not isinstance(found, collections.abc.Sequence) or len(found) != len(groups):
            self.fail(
                Invariant.RESULTS,
                f"group_block_tables({seq!r}) returned {found!r}",
                [f"expected: one block table per group, {len(groups)} in the order {names}"],
                Cause("group_block_tables returned other than one block table per group"),
            )
        tables = [self.results.block_table(f"{seq} (group {name})", table) for name, table in zip(names, found)]
        if tables[0] != group0:
            self.fail(
                Invariant.RESULTS,
                f"group_block_tables({seq!r}) gives group {names[0]} a table unlike block_table({seq!r})",
                [f"expected: {list(group0)} (group 0's table is the block table)", f"found:    {list(tables[0])}"],
                Cause("group_block_tables gave group 0 a table unlike block_table"),
            )
        return tables[1:]

    def one_group(self, touched: Iterable[int]) -> None:
        """Invariant 3 under groups: each touched block is mapped by the tables of one group at most (sequences may
        share it within that group, never across groups: the groups are different layers)."""
        h = self.state
        for block in touched:
            holders = h.refs.holders.get(block, ())
            groups = {h.seqs[holder].group for holder, _ in holders}
            if len(groups) > 1:
                self.fail(
                    Invariant.REFCOUNTS,
                    f"block {block} is mapped by the tables of {len(groups)} KV-cache groups at once",
                    [
                        "expected: a physical block in one group's tables at a time (each group is other layers, "
                        "with K/V of its own)",
                        f"found:    {h.entries(holders)}",
                        *self.pools.block_story(block),
                    ],
                    Cause("a block mapped by the tables of two KV-cache groups at once"),
                )

    def hit_window(self, seq: SeqId, num_cached: int) -> None:
        """Invariant 9, the hybrid rule: a hit of n tokens needs a sliding-window group's blocks covering positions
        [n - w + 1, n), the ones the next token (position n) reads besides its own; only blocks wholly before them
        may be dropped (NULL_BLOCK)."""
        h = self.state
        window = h.window(seq)
        if window is None or not num_cached:
            return
        layout, table = h.layout(seq), h.seqs[seq].table
        first = max(0, num_cached - window + 1)
        for index in range(layout.index(first), layout.blocks_for(num_cached)):
            if table[index] == NULL_BLOCK:
                self.fail(
                    Invariant.CACHE_SOUNDNESS,
                    f"cache hit of {num_cached} tokens for {h.label(seq)} leaves logical block {index} dropped, "
                    f"inside the window the next token reads",
                    [
                        f"expected: blocks holding positions {first}..{num_cached - 1} (sliding window {window}): a "
                        "hit of n tokens is valid only where every group holds what its attention reads at n",
                        f"found:    table {list(table)}",
                    ],
                    Cause("a cache hit that leaves a block the sliding window reads dropped"),
                )

    def hit_aligned(self, seq: SeqId, num_cached: int) -> None:
        """Invariant 9, the hybrid rule: a hit of n tokens ends on a block boundary of every group (n a multiple of
        each group's block size, so of their lcm: vLLM's ``scheduler_block_size``), unless it is the whole prompt of
        an engine that recomputes its last token. A hit ending inside a group's block leaves the rest of that block,
        which the hit took from the cache, to the next step's writes."""
        h = self.state
        if h.caps.recomputes_last_token and num_cached == h.length(seq):
            return
        sizes = [layout.size for layout in h.layouts]
        unaligned = [(group, size) for group, size in zip(h.caps.kv_groups, sizes) if num_cached % size]
        if unaligned:
            group, size = unaligned[0]
            self.fail(
                Invariant.CACHE_SOUNDNESS,
                f"cache hit of {num_cached} tokens for sequence {seq} ends inside a block of group {group.name} "
                f"({size} tokens per block)",
                [
                    f"expected: a hit that is a multiple of {math.lcm(*sizes)} tokens (every group's block size: "
                    f"{', '.join(f'{g.name} {s}' for g, s in zip(h.caps.kv_groups, sizes))}), so that each group's hit "
                    "covers whole blocks",
                    f"found:    {num_cached} cached tokens, ending at offset {num_cached % size} of group "
                    f"{group.name}'s logical block {num_cached // size}: that block would hold the hit's K/V before "
                    "the offset and the next step's writes after it",
                ],
                Cause("a cache hit ending inside a group's block"),
            )


def forget(core: EngineCore, table_id: SeqId) -> None:
    """A group table leaves with its sequence (freed, or dismissed while preempted)."""
    state = core.expected
    state.matchable.cancel(table_id)
    del state.seqs[table_id]
    state.retire(table_id)
    state.reference.remove(table_id)


class WindowDrops:
    """Under ``refusal_drops_window``: a refused grow may first drop the blocks wholly before its next token's window
    (vLLM's ``allocate_slots`` frees them before it checks for room)."""

    def __init__(self, core: EngineCore, groups: Optional[GroupTables]) -> None:
        self.core = core  # the engine this feature is part of
        self.groups = groups  # the sequence's group tables, under kv_groups

    def refused(self, seq: SeqId, before: Optional[PoolCounts], error: OutOfBlocks) -> Optional[PoolCounts]:
        """Record the blocks a refused grow of ``seq`` dropped out of its next token's window (each changed entry
        must be such a drop), released as a successful grow releases them; returns the pool counts the refusal must
        otherwise leave as they were."""
        core = self.core
        state = core.expected
        table_ids = (seq, *state.group_tables(seq))
        found = {table_id: core.checks.context.allocator_table(table_id) for table_id in table_ids}
        for table_id in table_ids:
            check_only_drops(core.checks.context, table_id, found[table_id], error)
        if all(found[table_id] == state.seqs[table_id].table for table_id in table_ids):
            return before
        for table_id in table_ids:
            state.seqs[table_id].dropped_at_length = state.length(seq)
        table = core.table(seq)
        released = f"dropped out of {seq}'s next window by its refused grow"
        change = core.set_table(seq, table, "kept by", released)
        if self.groups is not None:
            change = merged(change, self.groups.set_tables(seq, table, "kept by", released))
        core.settle(change)
        core.stats["blocks dropped by refused grows"] += len(change.released)
        return with_released(core.checks.context, before, change.released)


def check_only_drops(context: CheckContext, seq: str, table: tuple[int, ...], error: Exception) -> None:
    """Invariant 7 under ``refusal_drops_window``: a refused grow changed ``seq``'s table (or group table) at most
    by dropping entries (block -> ``NULL_BLOCK``); whether the window allowed each drop is the table's shape."""
    old = context.state.seqs[seq].table
    if len(table) == len(old) and all(new in (was, NULL_BLOCK) for was, new in zip(old, table)):
        return
    context.fail(
        Invariant.ATOMIC_REFUSAL,
        f"refused with {type(error).__name__}, but the block table of {context.state.label(seq)} changed other "
        "than by dropping blocks out of its window",
        [
            f"refusal: {error}",
            "expected: the table as before, some entries NULL_BLOCK at most (refusal_drops_window)",
            f"was:      {list(old)}",
            f"found:    {list(table)}",
        ],
        Cause("a refused grow that changed a table other than by dropping blocks out of its window"),
    )


def with_released(context: CheckContext, before: Optional[PoolCounts], released: Sequence[int]) -> Optional[PoolCounts]:
    """``before``, plus the ``released`` blocks (unreferenced now, their sets checked by the accounting) in the
    allocator's sets that hold them."""
    alloc = context.introspection
    if before is None or alloc is None or not released:
        return before
    gone = set(released)
    return attrs.evolve(
        before,
        free=before.free + len(gone & set(alloc.free_blocks())),
        cached=before.cached + len(gone & set(alloc.cached_blocks())),
        pending=before.pending + len(gone & set(alloc.pending_blocks())),
    )
