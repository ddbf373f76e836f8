"""Speculative decoding's look-ahead blocks (``lookahead_blocks``): the entries of a table beyond the blocks its
tokens fill, noted in their histories, held to their owner alone (invariant 5) and never cached once released
(invariant 9). The drafts a rollback may drop (``speculative_tokens``) are the expected state's.
"""

from __future__ import annotations

from kvfuzz.engine.core import EngineCore
from kvfuzz.engine.events import Completion, TableSet


class LookAhead:
    """Under ``lookahead_blocks``: the expected state's ``released_lookahead`` kept, and checked after every table
    update and step completion."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core  # the engine this feature is part of

    def table_set(self, record: TableSet) -> None:
        """Note the look-ahead entries a table keeps, remember those it released, and check both rules."""
        core, seq, table = self.core, record.seq, record.table
        state, pools = core.expected, core.pools
        held = core.blocks(state.length(seq) if record.held_tokens is None else record.held_tokens, seq)
        for index in range(core.blocks(state.length(seq), seq) if table else held, min(held, len(table))):
            pools.note(table[index], f"kept as look-ahead by {seq} (logical block {index})")
        state.released_lookahead |= {block for block in record.old[held:] if block in record.change.released}
        state.released_lookahead -= set(record.change.acquired)
        if table:
            core.checks.exclusive.lookahead_exclusive(seq, record.hit_tokens)
        core.checks.cache.lookahead_not_cached()

    def completed(self, completion: Completion) -> None:
        """A completion may have settled a released look-ahead block: still not cached."""
        self.core.checks.cache.lookahead_not_cached()
