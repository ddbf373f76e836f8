"""What a scheduler trace's replay found, and the refusal to replay one: shared by vLLM's replay
(:mod:`kvfuzz.scheduler.replay`) and SGLang's (:mod:`kvfuzz.scheduler.sglang.traces`)."""

from __future__ import annotations

from typing import Optional

import attrs

from kvfuzz.scheduler.trace import RecordedFailure, SchedulerTrace


class ReplayRefused(Exception):
    """The trace cannot be replayed here; the message is one line saying why."""


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
