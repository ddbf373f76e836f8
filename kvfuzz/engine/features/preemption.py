"""Preemption (``preemption``): a running sequence is released for recomputation. Its withdrawn scheduled writes
are never read (invariant 9), it keeps its tokens, and it waits to be readmitted (:meth:`kvfuzz.engine.Engine.readmit`,
an admission like any other).

The operation is a function of the engine core; :meth:`kvfuzz.engine.Engine.preempt` and the ``preempt`` row
(:data:`ROWS`, its row of the operation table) call it.
"""

from __future__ import annotations

from typing import cast

from kvfuzz.allocator.protocol import Preempts
from kvfuzz.allocator.types import SeqId
from kvfuzz.engine.arguments import Pick
from kvfuzz.engine.core import UNCHANGED, EngineCore, merged
from kvfuzz.engine.expected import Status
from kvfuzz.engine.operation import Operation


def preempt(core: EngineCore, seq: SeqId) -> None:
    """Release the running ``seq`` (and its group tables) for recomputation."""
    core.begin("preempt", seq)
    table_ids = (seq, *core.expected.group_tables(seq))
    for table_id in table_ids:
        core.withdraw_writes(table_id, f"preempt({seq!r})")
    core.events.fire_releasing(seq)
    core.call(lambda: cast(Preempts, core.allocator).preempt(seq))
    change = UNCHANGED
    for table_id in table_ids:
        change = merged(change, core.set_table(table_id, (), "released (preempt) by"))
        model = core.expected.seqs[table_id]
        model.status, model.written, model.drafts = Status.PREEMPTED, 0, 0
    core.expected.matchable.cancel(seq)
    core.settle(change)


ROWS: tuple[Operation, ...] = (
    Operation(
        "preempt",
        lambda engine, seq: preempt(engine, seq),
        (("seq", Pick(lambda state: state.preemptible_ids())),),
        needs=("preemption",),
        doc="release a running sequence for recomputation",
    ),
)
"""The feature's rows of the operation table."""
