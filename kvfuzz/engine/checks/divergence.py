"""Where an allocator first departed from the model: an audit of its whole observable state, run after every call
of a replay (never during a search), that names the operation that made a wrong change rather than the later one
that noticed its damage.

The checks that run during a search look only at what an operation changed (never the whole pool), so a wrong change
to a block the operation was not expected to touch (a reference released twice, once from another sequence's block)
is noticed by whichever later operation touches that block, or by another invariant once the block is handed out
again. The audit checks every block: run after each call of a failing program, the first call after which it fails
is where the allocator diverged, and its violation (the invariant, and the cause its check names, with the path of
that call) is what makes the failure one finding (:mod:`kvfuzz.shrink.signature`)."""

from __future__ import annotations

from kvfuzz.engine.checks.accounting import AccountingChecks
from kvfuzz.engine.checks.context import CheckContext, Checker


class DivergenceAudit(Checker):
    """The allocator's observable state, all of it, against the model. Changes nothing; raises the first violation
    it finds, labelled with the operation the engine last checked."""

    def __init__(self, context: CheckContext, accounting: AccountingChecks) -> None:
        super().__init__(context)
        self.accounting = accounting  # invariants 3 and 4

    def audit(self) -> None:
        """Every block's refcount and set membership (invariants 3 and 4)."""
        self.accounting.every_block()
