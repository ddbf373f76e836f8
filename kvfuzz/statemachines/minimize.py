"""Replaying a program without Hypothesis, and shrinking a failing one further by deleting calls.

Hypothesis shrinks within its own budget and sometimes keeps calls that do not matter (a step that changes nothing,
an admit whose blocks are never touched). Replaying is cheap, so kvfuzz then deletes chunks of calls, halving the
chunk size down to single calls (delta debugging), and keeps every deletion after which the program still breaks
the same invariant. A call whose arguments no longer make sense after a deletion (a grow of a sequence that was
never admitted) makes the candidate invalid, never a finding.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import attrs

from kvfuzz.statemachines.machine import KVCacheMachine, is_valid
from kvfuzz.statemachines.program import Call


class NotApplicable(Exception):
    """A call's rule is disabled or its arguments name sequences in the wrong state."""


@attrs.frozen
class ReplayOutcome:
    """What a replay raised, and at which call (``len(calls)`` for the teardown); both None if nothing failed."""

    failure: Optional[Exception]
    failed_at: Optional[int]


def replay(
    machine_class: type[KVCacheMachine], calls: Sequence[Call], on_call: Optional[Callable[[int, Call], None]] = None
) -> ReplayOutcome:
    """Run ``calls`` on a fresh machine, then its teardown, stopping at the first failure.

    Raises :class:`NotApplicable` if some call cannot be made in the state the earlier calls left.
    """
    machine = machine_class()
    for index, call in enumerate(calls):
        if not is_valid(machine, call):
            raise NotApplicable(f"call {index + 1}, {call}, cannot be made in the state the calls before it left")
        if on_call is not None:
            on_call(index, call)
        try:
            getattr(machine, call.rule)(**call.kwargs())
        except Exception as error:  # noqa: BLE001 -- the failure is the result
            return ReplayOutcome(error, index)
    try:
        machine.teardown()
    except Exception as error:  # noqa: BLE001
        return ReplayOutcome(error, len(calls))
    return ReplayOutcome(None, None)


def reproduces(machine_class: type[KVCacheMachine], calls: Sequence[Call], failure: type[Exception]) -> bool:
    try:
        return type(replay(machine_class, calls).failure) is failure
    except NotApplicable:
        return False


def minimize(
    machine_class: type[KVCacheMachine], calls: Sequence[Call], failure: type[Exception], seconds: float = 10.0
) -> list[Call]:
    """Delete as many calls as possible while the program still fails with ``failure``, within ``seconds``."""
    current = list(calls)
    deadline = time.perf_counter() + seconds
    chunk = max(1, len(current) // 2)
    while chunk >= 1 and time.perf_counter() < deadline:
        start, deleted = 0, False
        while start < len(current) and time.perf_counter() < deadline:
            candidate = current[:start] + current[start + chunk :]
            if candidate and reproduces(machine_class, candidate, failure):
                current, deleted = candidate, True
            else:
                start += chunk
        if not deleted:
            chunk //= 2
    return current
