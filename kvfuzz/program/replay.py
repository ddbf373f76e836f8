"""Replaying a program without Hypothesis, and shrinking a failing one further by deleting calls.

Hypothesis shrinks within its own budget and sometimes keeps calls that do not matter (a step that changes nothing,
an admit whose blocks are never touched). Replaying is cheap, so kvfuzz then deletes chunks of calls, halving the
chunk size down to single calls (delta debugging), then pairs of calls anywhere in the program, and keeps every
deletion after which the program still breaks the same invariant. A call whose arguments no longer make sense after
a deletion (a grow of a sequence that was never admitted) makes the candidate invalid, never a finding.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Optional, Sequence

import attrs

from kvfuzz.program.call import Call
from kvfuzz.program.execution import Execution, Target
from kvfuzz.program.safeguards import AllocatorHang
from kvfuzz.program.stats import failure_kind


class NotApplicable(Exception):
    """A call names no operation, its operation is disabled, or its arguments are ones the operation could not have
    drawn in the state the calls before it left."""


@attrs.frozen
class ReplayOutcome:
    """What a replay raised, and at which call (``len(calls)`` for the teardown); both None if nothing failed."""

    failure: Optional[BaseException]
    failed_at: Optional[int]


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
    execution = target.start()
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
                return ReplayOutcome(error, index)
        try:
            execution.teardown()
        except (Exception, AllocatorHang) as error:  # noqa: BLE001
            return ReplayOutcome(error, len(calls))
        return ReplayOutcome(None, None)
    finally:
        execution.engine.close()


def reproduces(target: Target, calls: Sequence[Call], kind: str) -> bool:
    """Whether replaying ``calls`` fails with a failure of this kind (:func:`~kvfuzz.program.stats.failure_kind`)."""
    try:
        failure = replay(target, calls).failure
    except NotApplicable:
        return False
    return failure is not None and failure_kind(failure) == kind


def minimize(target: Target, calls: Sequence[Call], kind: str, seconds: float = 10.0) -> list[Call]:
    """Delete as many calls as possible while the program still fails with a failure of ``kind``, within
    ``seconds``: chunks of calls, halving the chunk size down to single calls, then pairs of calls anywhere in the
    program (two calls that only matter together, such as a free and the admission whose blocks it returns), and
    single calls again after each pair that goes."""
    current = list(calls)
    deadline = time.perf_counter() + seconds
    chunk = max(1, len(current) // 2)
    while chunk >= 1 and time.perf_counter() < deadline:
        start, deleted = 0, False
        while start < len(current) and time.perf_counter() < deadline:
            candidate = current[:start] + current[start + chunk :]
            if candidate and reproduces(target, candidate, kind):
                current, deleted = candidate, True
            else:
                start += chunk
        if not deleted:
            chunk //= 2
    while time.perf_counter() < deadline:
        shorter = _without_a_pair(target, current, kind, deadline)
        if shorter is None:
            break
        current = _without_singles(target, shorter, kind, deadline)
    return current


def _without_a_pair(target: Target, calls: list[Call], kind: str, deadline: float) -> Optional[list[Call]]:
    """The program less the first pair of calls whose deletion still fails the same way, or None."""
    for first, second in itertools.combinations(range(len(calls)), 2):
        if time.perf_counter() >= deadline:
            return None
        candidate = [call for index, call in enumerate(calls) if index not in (first, second)]
        if candidate and reproduces(target, candidate, kind):
            return candidate
    return None


def _without_singles(target: Target, calls: list[Call], kind: str, deadline: float) -> list[Call]:
    """Delete single calls while the program still fails the same way."""
    index = 0
    while index < len(calls) and time.perf_counter() < deadline:
        candidate = calls[:index] + calls[index + 1 :]
        if candidate and reproduces(target, candidate, kind):
            calls = candidate
        else:
            index += 1
    return calls
