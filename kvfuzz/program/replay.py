"""Replaying a program without Hypothesis: a trace, a confirmation, a shrinker's candidate (:mod:`kvfuzz.shrink`).

A call whose arguments make no sense where it stands (a grow of a sequence that was never admitted) makes the replay
not applicable, never a finding; a shrinker's replay skips such a call instead.

A replay also audits the allocator's whole observable state after every call and every part of one
(:meth:`~kvfuzz.engine.engine.Engine.diverged`) until the audit first fails: where the allocator departed from the
model, which a failure's signature is keyed by. The audit reports nothing of its own: a program that never fails
is no finding, whatever it found.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import attrs

from kvfuzz.engine.violations import InvariantViolation
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Execution, Target
from kvfuzz.program.safeguards import AllocatorHang


class NotApplicable(Exception):
    """A call names no operation, its operation is disabled, or its arguments are ones the operation could not have
    drawn in the state the calls before it left."""


@attrs.frozen
class Divergence:
    """Where a replay's audit of the allocator's whole observable state first failed: its violation, labelled with
    the operation that made the wrong change, and the index of that call among the calls made."""

    violation: InvariantViolation = attrs.field(eq=False)
    at: int


@attrs.frozen
class ReplayOutcome:
    """What a replay raised, and at which call (``len(calls)`` for the teardown); both None if nothing failed.
    ``diverged``: where the audit first failed, before the failure (None: it never did)."""

    failure: Optional[BaseException]
    failed_at: Optional[int]
    diverged: Optional[Divergence] = None


class _FirstDivergence:
    """The first divergence an execution's audits find (after every call, and at the boundaries inside one)."""

    def __init__(self, execution: Execution) -> None:
        self.execution = execution
        self.found: Optional[Divergence] = None
        self.closed = False  # the program's calls are over: the teardown's changes are not the program's
        self.unchanged = True  # nothing has begun since the last audit
        execution.engine.at_boundaries(self.boundary, self.audit)

    def boundary(self) -> None:
        """Between two parts of a call: the first operation a call begins follows the audit after the call before,
        with nothing between them to audit."""
        if self.unchanged:
            self.unchanged = False
            return
        self.audit()
        self.unchanged = False

    def audit(self) -> None:
        if self.found is None and not self.closed:
            violation = self.execution.engine.diverged()
            if violation is not None:
                self.found = Divergence(violation, len(self.execution.calls) - 1)
        self.unchanged = True


Rewrite = Callable[[int, Call, Execution], Call]
"""Called before each call of a replay with the execution as the calls before it left it; the call it returns is
made in its place (a shrinker re-aiming a targeted eviction at the block that now holds what it evicted)."""


def replay(
    target: Target,
    calls: Sequence[Call],
    on_call: Optional[Callable[[int, Call], None]] = None,
    rewrite: Optional[Rewrite] = None,
    skip_stranded: bool = False,
) -> ReplayOutcome:
    """Run ``calls`` on a fresh allocator, then the teardown, stopping at the first failure (a hang included).

    Raises :class:`NotApplicable` if some call cannot be made in the state the earlier calls left; with
    ``skip_stranded`` such a call is skipped instead (a shrinker's candidate, where a deletion stranded it), and
    ``on_call`` sees only the calls made. ``failed_at`` indexes ``calls``, skipped calls included.
    """
    try:
        execution = target.start()
    except (Exception, AllocatorHang) as error:  # noqa: BLE001 -- the factory failed before the first call
        return ReplayOutcome(error, 0)
    first = _FirstDivergence(execution)
    try:
        for index, call in enumerate(calls):
            if rewrite is not None:
                call = rewrite(index, call, execution)
            if not execution.accepts(call):
                if skip_stranded:
                    continue
                raise NotApplicable(f"call {index + 1}, {call}, cannot be made in the state the calls before it left")
            if on_call is not None:
                on_call(index, call)
            try:
                execution.execute(call.rule, call.kwargs())
            except (Exception, AllocatorHang) as error:  # noqa: BLE001 -- the failure is the result
                return ReplayOutcome(error, index, first.found)
            first.audit()
        first.closed = True
        try:
            execution.teardown()
        except (Exception, AllocatorHang) as error:  # noqa: BLE001
            return ReplayOutcome(error, len(calls), first.found)
        return ReplayOutcome(None, None, first.found)
    finally:
        execution.engine.close()
