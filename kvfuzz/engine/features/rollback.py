"""Rollback (``rollback``): a sequence drops its last tokens (rejected speculative drafts). The table left is a
prefix of the table before, beyond which only look-ahead blocks may stay (invariant 1's table check); the blocks
released start their in-flight windows like any release. The table check is the feature's own (only a rollback
triggers it).

The operation is a function of the engine core; :meth:`kvfuzz.engine.Engine.rollback` and the ``rollback`` row
(:data:`ROWS`, its row of the operation table) call it; the row drops at most the state's ``rollback_limit``.
"""

from __future__ import annotations

from typing import cast

from kvfuzz.allocator.protocol import RollsBack
from kvfuzz.allocator.types import SeqId
from kvfuzz.engine.arguments import Integers, Pick
from kvfuzz.engine.checks import CheckContext
from kvfuzz.engine.core import EngineCore
from kvfuzz.engine.operation import Operation
from kvfuzz.engine.violations import Cause, Invariant


def rollback(core: EngineCore, seq: SeqId, num_tokens: int) -> None:
    """Drop the last ``num_tokens`` tokens of ``seq``."""
    state = core.expected
    core.begin("rollback", seq, num_tokens)
    core.call(lambda: cast(RollsBack, core.allocator).rollback(seq, num_tokens))
    model = state.seqs[seq]
    old_len = state.length(seq)
    new_len = old_len - num_tokens
    state.reference.truncate(seq, new_len)
    model.written = min(model.written, new_len)
    state.matchable.cancel(seq, new_len // state.layout(seq).size)
    model.drafts = max(0, model.drafts - num_tokens)
    table = core.table(seq)
    check_rollback_table(core.checks.context, seq, model.table, table)
    released = f"released by {seq}'s rollback of {num_tokens} token(s), to length {new_len}"
    core.settle(core.set_table(seq, table, "after rollback, given to", released, held_tokens=old_len))


def check_rollback_table(context: CheckContext, seq: str, before: tuple[int, ...], table: tuple[int, ...]) -> None:
    """Invariant 1: a rollback leaves a prefix of the table: every kept position stays in its block."""
    if table != before[: len(table)]:
        context.fail(
            Invariant.CONTENT,
            f"rollback of {seq} changed the blocks of positions it kept",
            [
                f"expected: a prefix of its table before the rollback, {list(before)}",
                f"found:    {list(table)}",
                *(
                    line
                    for index, (old, new) in enumerate(zip(before, table))
                    if old != new
                    for line in context.pools.block_story(old)
                ),
            ],
            Cause("a rollback that changed the blocks of positions it kept"),
        )


def _rollback(engine: EngineCore, seq: SeqId, num_tokens: int) -> None:
    rollback(engine, seq, min(num_tokens, engine.expected.rollback_limit(seq)))


ROWS: tuple[Operation, ...] = (
    Operation(
        "rollback",
        _rollback,
        (("seq", Pick(lambda state: state.rollbackable_ids())), ("num_tokens", Integers(1, 6))),
        needs=("rollback",),
        doc="reject drafts: drop that many tokens, or as many as leave one (and, under a sliding window, no dropped "
        "block back in the window)",
    ),
)
"""The feature's rows of the operation table."""
