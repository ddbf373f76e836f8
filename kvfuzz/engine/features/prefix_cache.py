"""The prefix cache's declared policy of complete caching (``complete_caching``): every full block a completed step
wrote is owed matchable until an eviction or a reset drops it. The engine notes the blocks each step fills, owes them
once that step has surely completed, and has invariant 14 checked at admissions and releases
(:mod:`kvfuzz.engine.checks.complete_caching`); the debt itself is the expected state's ``matchable``.
"""

from __future__ import annotations

from typing import Sequence

from kvfuzz.allocator.types import NULL_BLOCK, SeqId
from kvfuzz.engine.core import EngineCore
from kvfuzz.engine.events import Completion, TableSet
from kvfuzz.engine.expected import Status
from kvfuzz.engine.matchable import Filled


class CachingDebt:
    """Under complete caching, where the allocator shows its sets and no sliding window drops blocks (the
    context's ``owes_caching``): what the cache owes."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core  # the engine this feature is part of

    def owed(self, tags: Sequence[int]) -> list[tuple[int, str]]:
        """What an admission of a prompt with these tags must report cached (before the allocator is called)."""
        return self.core.checks.complete_caching.owed_hit(tags)

    def table_set(self, record: TableSet) -> None:
        """A block owed matchable that a table released stays matchable."""
        for block in record.change.released:
            self.core.checks.complete_caching.released_matchable(block)

    def scheduling(self, step: int) -> None:
        """Step ``step`` is scheduled: the full blocks each running table's writes fill are noted."""
        for seq in self.core.expected.ids(Status.RUNNING, groups=True):
            self._note_filled(seq, step)

    def _note_filled(self, seq: SeqId, step: int) -> None:
        """The full blocks of ``seq`` that step ``step`` fills are owed matchable once the step its writes were
        scheduled for has surely completed (step c + W + 1, c the last completed now). A block that holds drafts of
        the latest grow is not: a rollback may still reject them, and an allocator caches only verified tokens
        (vLLM's ``allocate_slots`` caches up to ``request.num_tokens``, never a draft)."""
        core = self.core
        model, size = core.expected.seqs[seq], core.expected.layout(seq).size
        due = core.pools.last_completed + core.caps.inflight_window + 1
        tags = core.expected.reference.tags(seq)
        for index in range(model.written // size, (len(tags) - model.drafts) // size):
            block = model.table[index]
            if block != NULL_BLOCK:
                written = f"{seq} as its logical block {index} at step {step}"
                core.expected.matchable.fill(Filled(due, seq, index, block, tags[(index + 1) * size - 1], written))

    def completed(self, completion: Completion) -> None:
        """The blocks filled in time for this step's completion are owed matchable, if their writer still maps
        them."""
        state = self.core.expected
        for filled in state.matchable.due(completion.step):
            model = state.seqs.get(filled.seq)
            if (
                model is not None
                and model.status is Status.RUNNING
                and filled.index < len(model.table)
                and model.table[filled.index] == filled.block
                and model.written >= state.layout(filled.seq).first_position(filled.index + 1)
            ):
                state.matchable.owe(filled)
