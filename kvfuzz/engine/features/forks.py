"""Forks (``fork``): parallel sampling and beam search. A child shares every block of its parent's table, or gets
the copies the allocator returned, and then its table differs from the parent's exactly at their destinations
(invariant 4); every copy's destination is the child's alone (5) and outside the in-flight window (6). The check
that copies come only with ``fork_copies`` (3) is the feature's own.

The operation is a function of the engine core (the groups feature, when declared, records the child's group
tables); :meth:`kvfuzz.engine.Engine.fork` and the ``fork`` row (:data:`ROWS`, its row of the operation table) call
it.
"""

from __future__ import annotations

from typing import Optional, Sequence, cast

from kvfuzz.allocator.protocol import Forks
from kvfuzz.allocator.types import BlockCopy, SeqId
from kvfuzz.engine.arguments import NewSeqId, Pick, computed
from kvfuzz.engine.checks import CheckContext
from kvfuzz.engine.core import EngineCore, merged
from kvfuzz.engine.expected import SeqModel, Status
from kvfuzz.engine.features.groups import GroupTables
from kvfuzz.engine.operation import Operation
from kvfuzz.engine.violations import Cause, Invariant


def _fork_copies(result: object) -> object:
    """fork's copies as a tuple (None means every block is shared); anything else is left for the checks to name."""
    if result is None:
        return ()
    return tuple(result) if isinstance(result, list) else result


def fork(core: EngineCore, groups: Optional[GroupTables], parent: SeqId, child: SeqId) -> bool:
    """``child`` shares all of ``parent``'s blocks, or gets the copies the allocator returned; returns whether the
    allocator found room."""
    state, checks = core.expected, core.checks
    core.begin("fork", parent, child)
    needed = int(core.caps.fork_copies and state.length(parent) % state.layout(parent).size != 0)
    needed += core.caps.lookahead_blocks  # the child may get look-ahead blocks of its own
    before = checks.eviction_order.snapshot()
    # Checked as a tuple of BlockCopy by the result check before it is used as one.
    copies = cast(
        Optional[tuple[BlockCopy, ...]],
        core.attempt(
            lambda: _fork_copies(cast(Forks, core.allocator).fork(parent, child)), tuple, needed, absent=child
        ),
    )
    if copies is None:
        return False
    check_copies_declared(checks.context, parent, child, copies)
    state.matchable.forget(copy.dst for copy in copies)
    for copy in copies:
        core.pools.copy_block(copy.src, copy.dst)
        core.stats["fork copies"] += 1
    state.reference.fork(parent, child)
    parent_table = state.seqs[parent].table
    state.seqs[child] = SeqModel(
        child, Status.RUNNING, written=state.seqs[parent].written, joined_step=core.pools.next_step
    )
    table = core.table(child)
    moved_to = {copy.src: copy.dst for copy in copies}
    filled = parent_table[: state.num_blocks_for(parent)]
    checks.accounting.fork_table(parent, child, tuple(moved_to.get(block, block) for block in filled), table)
    layout, written = state.layout(child), state.seqs[child].written
    moved = [index for index, (old, new) in enumerate(zip(parent_table, table)) if old != new]
    change = core.set_table(child, table, "shared by fork with")
    if groups is not None:
        change = merged(change, groups.forked(parent, child, table, written))
    core.settle(
        change,
        [
            (child, p)
            for index in moved
            for p in range(layout.first_position(index), min(layout.first_position(index + 1), written))
        ],
    )
    checks.eviction_order.evictions(before, (), reuse=True)
    for copy in copies:
        checks.exclusive.block(copy.dst, child, f"fork copy from block {copy.src}")
    checks.window.outside({copy.dst for copy in copies}, child)
    return True


def check_copies_declared(context: CheckContext, parent: str, child: str, copies: Sequence[BlockCopy]) -> None:
    """Invariant 3: fork copies blocks only when the allocator declares ``fork_copies``."""
    if copies and not context.state.caps.fork_copies:
        context.fail(
            Invariant.REFCOUNTS,
            f"fork of {parent} into {child} returned copies {list(copies)}",
            ["expected: none: the allocator does not declare fork_copies, so fork shares every block"],
            Cause("a fork that returned copies without declaring fork_copies"),
        )


ROWS: tuple[Operation, ...] = (
    Operation(
        "fork",
        lambda engine, parent, child: fork(engine, engine.groups, parent, child),
        (("parent", Pick(computed)), ("child", NewSeqId())),
        needs=("fork",),
        doc="parallel sampling or beam search: the child shares the parent's blocks",
    ),
)
"""The feature's rows of the operation table."""
