"""Rollback (``rollback``): a sequence drops its last tokens (rejected speculative drafts). The table left is a
prefix of the table before, beyond which only look-ahead blocks may stay (invariant 1's table check); the blocks
released start their in-flight windows like any release.

The operation is a function of the engine core; :meth:`kvfuzz.engine.Engine.rollback` and the operation table's
``rollback`` row call it.
"""

from __future__ import annotations

from typing import cast

from kvfuzz.allocator.protocol import RollsBack
from kvfuzz.allocator.types import SeqId
from kvfuzz.engine.core import EngineCore


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
    core.checks.content.rollback_table(seq, model.table, table)
    released = f"released by {seq}'s rollback of {num_tokens} token(s), to length {new_len}"
    core.settle(core.set_table(seq, table, "after rollback, given to", released, held_tokens=old_len))
