"""KV-cache groups and sliding windows (``kv_groups``, ``refusal_drops_window``): a sequence's tables in groups 1
onwards, read back and recorded beside its own (group 0's), forked and forgotten with it; and the blocks a refused
grow may drop out of its next token's window.

A group table is a sequence of its own in the expected state (``group_seq``), so every other check holds of it as
it holds of a sequence; the checks only groups need are :class:`~kvfuzz.engine.checks.groups.GroupChecks`. The check
that a refused grow only dropped blocks out of the window (invariant 7) is :class:`WindowDrops`'s own.
"""

from __future__ import annotations

from typing import Optional, Sequence

import attrs

from kvfuzz.allocator.errors import OutOfBlocks
from kvfuzz.allocator.types import NULL_BLOCK, Namespace, SeqId, Tokens
from kvfuzz.engine.checks import CheckContext, PoolCounts
from kvfuzz.engine.checks.groups import GroupChecks
from kvfuzz.engine.core import UNCHANGED, EngineCore, merged
from kvfuzz.engine.expected import SeqModel, Status, TableChange
from kvfuzz.engine.groups import group_namespace
from kvfuzz.engine.violations import Invariant


class GroupTables:
    """Under ``kv_groups``: the engine's side of a sequence's tables in groups 1 onwards."""

    def __init__(self, core: EngineCore, checks: GroupChecks) -> None:
        self.core = core  # the engine this feature is part of
        self.checks = checks  # the group tables' own checks

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
