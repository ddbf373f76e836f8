"""Invariants 7, 8 and 11, refusals: a refusal changes nothing (atomic), is justified (no false out-of-blocks), and
only a contract-breaking call is refused as misuse."""

from __future__ import annotations

import re
from typing import NoReturn, Optional

import attrs

from kvfuzz.allocator.errors import AllocatorError, Misuse
from kvfuzz.engine.checks.accounting import AccountingChecks
from kvfuzz.engine.checks.context import CheckContext, Checker, PoolCounts
from kvfuzz.engine.expected import Status
from kvfuzz.engine.misuse import MisuseCall
from kvfuzz.engine.violations import Cause, Invariant


def misuse_kind(call: MisuseCall) -> str:
    """Why ``call`` breaks the contract, without the sequence it names (``s3 was already freed``: ``a sequence was
    already freed``): the same misuse, whichever sequence a program used."""
    return re.sub(r"\bs\d+\b", "a sequence", call.why)


class RefusalChecks(Checker):
    """Invariants 7, 8 and 11; a refusal's pool is checked again by the accounting checks."""

    def __init__(self, context: CheckContext, accounting: AccountingChecks) -> None:
        super().__init__(context)
        self.accounting = accounting  # invariants 3 and 4, run on the pool a refusal leaves

    def unchanged(
        self,
        invariant: Invariant,
        before: Optional[PoolCounts],
        error: Exception,
        absent: Optional[str] = None,
        cached_before: Optional[frozenset[int]] = None,
    ) -> frozenset[int]:
        """After a refusal, every running table, the touched refcounts and the counts are as before; returns the
        blocks the refusal evicted.

        ``cached_before`` (the cached set before the call) is given where the allocator declares ``refusal_evicts``:
        then cached blocks may have moved to the free set, and nothing else."""
        h = self.state
        for seq, model in h.seqs.items():
            if model.status is not Status.RUNNING:
                continue
            table = self.context.allocator_table(seq)
            if table != model.table:
                self.fail(
                    invariant,
                    f"refused with {type(error).__name__}, but the block table of {h.label(seq)} changed",
                    [f"refusal: {error}", f"expected: {list(model.table)}", f"found:    {list(table)}"],
                    Cause("a refusal that changed a running sequence's block table"),
                )
        if absent is not None:
            try:
                absent_table = tuple(self.allocator.block_table(absent))
            except Misuse:
                pass
            else:
                self.fail(
                    invariant,
                    f"refused with {type(error).__name__}, but {absent} now has a block table",
                    [f"refusal: {error}", f"found: {list(absent_table)}"],
                    Cause("a refusal that left the refused sequence a block table"),
                )
        after = self.context.counts()
        evicted = self._evicted_by_refusal(invariant, before, error, cached_before)
        if before is not None and evicted:
            before = attrs.evolve(before, free=before.free + len(evicted), cached=before.cached - len(evicted))
        if after != before:
            self.fail(
                invariant,
                f"refused with {type(error).__name__}, but the pool changed",
                [
                    f"refusal: {error}",
                    f"expected: {before} (as before the call"
                    + (
                        f", less the {len(evicted)} evicted cached block(s) {sorted(evicted)} now free)"
                        if evicted
                        else ")"
                    ),
                    f"found:    {after}",
                ],
                Cause("a refusal that changed the pool (blocks taken or released before the refusal)"),
            )
        self.accounting.touched({*h.refs.holders, *evicted})
        return evicted

    def _evicted_by_refusal(
        self,
        invariant: Invariant,
        before: Optional[PoolCounts],
        error: Exception,
        cached_before: Optional[frozenset[int]],
    ) -> frozenset[int]:
        """Under ``refusal_evicts``: the cached blocks a refusal dropped, each now free; no block became cached."""
        cached_after = self.context.cached_set()
        if cached_before is None or cached_after is None:
            return frozenset()
        joined = sorted(cached_after - cached_before)
        if joined:
            self.fail(
                invariant,
                f"refused with {type(error).__name__}, but block(s) {joined} became cached",
                [f"refusal: {error}", "expected: a refusal may only drop cached, unreferenced blocks (refusal_evicts)"],
                Cause("a refusal that made blocks cached"),
            )
        return cached_before - cached_after

    def not_false(self, needed: int, error: AllocatorError, host: bool = False) -> None:
        """An out-of-blocks refusal while the free and evictable blocks cover the request is false."""
        h = self.state
        if host:
            available = h.num_host_blocks - h.host_blocks_in_use()
            where = "host pool"
        else:
            in_window = len(self.context.unreferenced_in_inflight_window())
            available = h.num_blocks - h.refs.num_referenced() - in_window - h.caps.reserved_blocks
            where = "device pool"
        if needed <= available:
            self.fail(
                Invariant.NO_FALSE_REFUSAL,
                f"refused for lack of blocks while the {where} could serve it",
                [
                    f"refusal: {error}",
                    f"needed:    at most {needed} block(s)",
                    f"available: {available} unreferenced block(s) outside the in-flight window"
                    + (f", beyond {h.caps.reserved_blocks} reserved" if not host and h.caps.reserved_blocks else ""),
                ],
                Cause(f"an out-of-blocks refusal while the {where} could serve it"),
            )

    def valid_call_refused(self, error: AllocatorError, out_of_blocks_allowed: bool) -> NoReturn:
        """Invariant 11: a call within the contract was refused with an error other than running out of blocks."""
        self.fail(
            Invariant.MISUSE,
            f"a valid call was refused with {type(error).__name__}: {error}",
            ["expected: the call to succeed" + (", or OutOfBlocks" if out_of_blocks_allowed else "")],
            Cause(f"a valid call refused with {type(error).__name__}", by_operation=True),
        )

    def misuse_refused_untyped(self, call: MisuseCall, error: Exception) -> NoReturn:
        """Invariant 11: a contract-breaking call raised something other than a Misuse error."""
        self.fail(
            Invariant.MISUSE,
            f"{call} ({call.why}) raised {type(error).__name__}: {error}",
            ["expected: a kvfuzz.allocator.errors.Misuse subclass, with nothing changed"],
            Cause(
                f"a contract-breaking {call.op} ({misuse_kind(call)}) that raised {type(error).__name__}, not Misuse"
            ),
        )

    def misuse_accepted(self, call: MisuseCall) -> NoReturn:
        """Invariant 11: a contract-breaking call was accepted."""
        self.fail(
            Invariant.MISUSE,
            f"{call} ({call.why}) was accepted silently",
            ["expected: a kvfuzz.allocator.errors.Misuse subclass, with nothing changed"],
            Cause(f"a contract-breaking {call.op} ({misuse_kind(call)}) accepted silently"),
        )
