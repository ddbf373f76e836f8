"""Where an allocator first departed from the model: an audit of its whole observable state, run after every call
of a replay (never during a search), that names the operation that made a wrong change rather than the later one
that noticed its damage.

The checks that run during a search look only at what an operation changed (never the whole pool), so a wrong change
to a block the operation was not expected to touch (a reference released twice, once from another sequence's block)
is noticed by whichever later operation touches that block, or by another invariant once the block is handed out
again. The audit checks every block: run after each call of a failing program, the first call after which it fails
is where the allocator diverged, and its violation (the invariant, and the cause its check names, with the path of
that call) is what makes the failure one finding (:mod:`kvfuzz.shrink.signature`).

Likewise a table that a call on another sequence altered is wrong from that call on (a later read of it crashes, or
leaks, or reads the wrong K/V), and a cache that keeps a block whose scheduled writes a preemption withdrew is wrong
from that preemption on (a later hit on it is noticed as a hit on K/V no step wrote, or on another prefix's K/V once
the block is reused). The audit is read-only, needs introspection for the blocks' refcounts and sets, and finds
nothing on a correct allocator (``tests/test_divergence.py`` runs random programs on kvfuzz's own to check it)."""

from __future__ import annotations

from kvfuzz.engine.checks.accounting import AccountingChecks
from kvfuzz.engine.checks.cache import UNWRITTEN, WITHDRAWN
from kvfuzz.engine.checks.context import CheckContext, Checker
from kvfuzz.engine.expected import Status
from kvfuzz.engine.violations import Cause, Invariant

TABLE_CHANGED = Cause("a block table changed by a call that does not change it (a table another call altered)")


class DivergenceAudit(Checker):
    """The allocator's observable state, all of it, against the model. Changes nothing; raises the first violation
    it finds, labelled with the operation the engine last checked."""

    def __init__(self, context: CheckContext, accounting: AccountingChecks) -> None:
        super().__init__(context)
        self.accounting = accounting  # invariants 3 and 4

    def audit(self) -> None:
        """Every block's refcount and set membership (invariants 3 and 4), every running table as the engine last
        recorded it (invariant 3), and no block in the cached set whose scheduled writes were withdrawn
        (invariant 9)."""
        self.accounting.every_block()
        self.tables_unchanged()
        self.withdrawn_uncached()

    def tables_unchanged(self) -> None:
        """Invariant 3: every running sequence's block table (and group table) is the one the engine recorded when a
        call last changed it: a call on one sequence that alters another's table (a list shared by a fork, say) is
        wrong there, whatever later read of that table shows it."""
        state = self.state
        for seq in state.ids(Status.RUNNING, groups=True):
            expected = state.seqs[seq].table
            found = self.context.allocator_table(seq)
            if found != expected:
                self.fail(
                    Invariant.REFCOUNTS,
                    f"the block table of {state.label(seq)} changed though no call changed it",
                    [f"expected: {list(expected)} (as recorded when it last changed)", f"found:    {list(found)}"],
                    TABLE_CHANGED,
                )

    def withdrawn_uncached(self) -> None:
        """Invariant 9: a block whose scheduled writes a preemption or an abort withdrew (and no write has filled
        since) is not offered by the cache, whether or not a hit has already relied on it: the wrong change is made
        by the call that withdrew the writes and left the block cached, whatever later hit (or other prefix's write
        into it) shows the damage.

        Its cause is the wrong change's: under ``hits_scheduled_writes`` caching scheduled writes is allowed, and the
        withdrawal that left them cached is wrong (the cause of a hit that relied on them when they were withdrawn);
        without it, caching them before a step completed was wrong already (the cause of a hit on them)."""
        withdrawn = self.pools.withdrawn
        cached = self.context.cached_set() if withdrawn else None
        for block, why in sorted(withdrawn.items()):
            if cached is not None and block in cached:
                self.fail(
                    Invariant.CACHE_SOUNDNESS,
                    f"block {block} is in the cached set though {why} withdrew the writes scheduled into it",
                    [
                        "expected: a block uncached when the writes that were to fill it are withdrawn (a hit on it "
                        "reads K/V no step wrote)",
                        *self.pools.block_story(block),
                    ],
                    WITHDRAWN if self.state.caps.hits_scheduled_writes else UNWRITTEN,
                )
