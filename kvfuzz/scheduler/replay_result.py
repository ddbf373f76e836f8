"""What a scheduler trace's replay found, and the refusal to replay one: shared by vLLM's replay
(:mod:`kvfuzz.scheduler.replay`) and SGLang's (:mod:`kvfuzz.scheduler.sglang.traces`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import attrs

from kvfuzz.program.safeguards import raise_stop_behind
from kvfuzz.scheduler.harness import raise_if_kvfuzz_s
from kvfuzz.scheduler.program import Operation
from kvfuzz.scheduler.trace import RecordedFailure, SchedulerTrace


class ReplayRefused(Exception):
    """The trace cannot be replayed here; the message is one line saying why."""


class RunnerUnavailable(ReplayRefused):
    """The trace was recorded under a model runner protocol the installed vLLM no longer has (the V1 runner, gone
    in vLLM 0.34.0): like a trace whose engine is not installed, it is skipped here, with this line."""


@attrs.frozen
class SchedulerReplay:
    """What a replay found: the failure (None: every check passed) and where: the index of the operation that
    failed, or ``len(program)`` for the drain."""

    trace: SchedulerTrace
    failure: Optional[RecordedFailure]
    failed_at: Optional[int]
    error: Optional[Exception] = attrs.field(default=None, eq=False, repr=False)  # the exception itself

    @property
    def failed(self) -> bool:
        return self.failure is not None

    @property
    def reproduced(self) -> bool:
        """The recorded failure happened again: the same check (for a crash, the same exception type)."""
        return self.failure is not None and self.failure.same_kind(self.trace.failure)

    @property
    def identical(self) -> bool:
        """The message is the recorded one, word for word (the target is deterministic, so it should be)."""
        return self.failure is not None and self.failure.message == self.trace.failure.message

    def where(self) -> str:
        if self.failed_at is None:
            return "nowhere"
        return "the drain" if self.failed_at == len(self.trace.program) else f"operation {self.failed_at + 1}"

    def describe_failure(self) -> str:
        if self.failure is None:
            return "every check passed"
        return self.failure.describe()


def replay_program(
    session: Any, trace: SchedulerTrace, on_operation: Optional[Callable[[int, Operation], None]] = None
) -> SchedulerReplay:
    """Apply ``trace``'s program to ``session`` (either engine's), then drain it: the first exception (a check's
    violation, or the engine's own) is the replay's finding, at its operation's index or ``len(program)`` for the
    drain. ``on_operation`` is told of each operation before it runs. An exception kvfuzz's own code raised is no
    finding: it leaves as a :class:`~kvfuzz.scheduler.harness.HarnessError`; nor is one raised as a stop from outside
    (the user's interrupt, a campaign's end) unwound the session: the stop is raised again."""
    for index, operation in enumerate(trace.program):
        if on_operation is not None:
            on_operation(index, operation)
        try:
            operation.apply(session)
        except Exception as error:  # noqa: BLE001 -- a check's violation, or the engine's own exception: the finding
            return SchedulerReplay(trace, RecordedFailure.of(_not_kvfuzz_s(error, session)), index, error)
    try:
        session.drain()
    except Exception as error:  # noqa: BLE001 -- as above
        return SchedulerReplay(trace, RecordedFailure.of(_not_kvfuzz_s(error, session)), len(trace.program), error)
    return SchedulerReplay(trace, None, None)


def _not_kvfuzz_s(error: Exception, session: Any) -> Exception:
    """``error``, unless a stop from outside is behind it (raised again) or kvfuzz's own code raised it (then its
    :class:`~kvfuzz.scheduler.harness.HarnessError`)."""
    raise_stop_behind(error)
    raise_if_kvfuzz_s(error, lambda: session.engine)
    return error
