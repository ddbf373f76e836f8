"""Saving a scheduler target's failure to the corpus, so that none is lost: the first failing example is saved the
moment it fails, before Hypothesis starts shrinking it (a crash or a kill during shrinking loses nothing), and the
shrunk example replaces it once the search ends. A corpus that cannot be written raises nothing: the report then
shows the whole trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import attrs

from kvfuzz.scheduler.engines import installed_version
from kvfuzz.scheduler.program import Operation
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.trace import RecordedFailure, SchedulerTrace, save


def vllm_version() -> str:
    """The installed vLLM's version (without importing it)."""
    return installed_version("vllm")


@attrs.frozen
class SavedSchedulerTrace:
    """Where a trace went: written to ``path``, already there, or (``error``) nowhere but memory."""

    trace: SchedulerTrace
    path: Path  # where it is, or would have been, saved
    written: bool  # False when the same trace was already there, or when it could not be written
    error: Optional[str] = None  # why it could not be written; None once it is on disk

    def report(self) -> str:
        if self.error is None:
            where = "saved to" if self.written else "already in the corpus:"
            return (
                f"trace {where} {self.path}\nreplay it with: kvfuzz replay {self.path}\n"
                f"see it with: kvfuzz show {self.path}"
            )
        return (
            f"trace NOT saved: cannot write {self.path} ({self.error}); here it is: save it as {self.path.name} and "
            f"replay it with: kvfuzz replay {self.path.name}\n{json.dumps(self.trace.to_json(), indent=2)}"
        )


def trace_fields(saved: Optional[SavedSchedulerTrace]) -> dict[str, Any]:
    """A run's ``--json`` fields for its trace: ``trace`` (where it was saved, or null), ``trace_error`` (why it
    could not be, or null) and ``unsaved_trace`` (the trace itself when it could not be)."""
    unsaved = saved is not None and saved.error is not None
    return {
        "trace": str(saved.path) if saved is not None and not unsaved else None,
        "trace_error": saved.error if saved is not None else None,
        "unsaved_trace": saved.trace.to_json() if saved is not None and unsaved else None,
    }


def save_scheduler_trace(trace: SchedulerTrace, directory: Path) -> SavedSchedulerTrace:
    try:
        path, written = save(trace, directory)
    except OSError as error:
        return SavedSchedulerTrace(trace, directory / trace.file_name(), False, error.strerror or str(error))
    return SavedSchedulerTrace(trace, path, written)


class FailureRecorder:
    """The search's witness (:data:`kvfuzz.scheduler.machine.Witness`): saves the first failing example at once and
    keeps the latest (Hypothesis replays the shrunk example last); :meth:`finish` saves that one."""

    def __init__(self, scheduler: str, directory: Path) -> None:
        self.scheduler = scheduler  # the target's name (``--scheduler``)
        self.directory = directory  # the corpus
        self.first: Optional[SavedSchedulerTrace] = None  # the unshrunk trace, saved when found
        self.latest: Optional[tuple[SchedulerTrace, BaseException]] = None  # the last failing example seen
        self._version = vllm_version()

    def _trace(self, session: Session, error: BaseException, shrunk: bool) -> SchedulerTrace:
        program: tuple[Operation, ...] = tuple(session.program)
        runner = "V2" if session.worker.runner_v2 else "V1"
        failure = RecordedFailure.of(error)
        return SchedulerTrace(
            self.scheduler,
            session.setup,
            runner,
            self._version,
            program,
            failure,
            shrunk,
            write_path=session.worker.write_path.name,
            attention=session.worker.attention.name,
        )

    def __call__(self, session: Session, error: BaseException) -> None:
        if self.first is None:
            self.first = save_scheduler_trace(self._trace(session, error, shrunk=False), self.directory)
        self.latest = (self._trace(session, error, shrunk=True), error)

    def finish(self, failure: Optional[BaseException], shrunk: bool) -> Optional[SavedSchedulerTrace]:
        """Save the search's ``failure`` (the latest failing example, which Hypothesis replays last) and remove the
        unshrunk trace it supersedes, only if that one failed the same way: Hypothesis reports one failure, and when
        shrinking met another kind it may report that one, so the first stays on disk, never lost; returns where the
        reported trace is (None when nothing failed)."""
        if self.latest is None or failure is None:
            return self.first
        trace, error = self.latest
        if error is not failure or not shrunk:  # not the failure the search reports: the first one stands
            return self.first
        saved = save_scheduler_trace(trace, self.directory)
        first = self.first
        if (
            saved.error is None
            and first is not None
            and first.written
            and first.path != saved.path
            and trace.failure.same_kind(first.trace.failure)  # a different failure met while shrinking keeps both
        ):
            first.path.unlink(missing_ok=True)
        return saved
