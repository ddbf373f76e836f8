"""Saving a scheduler target's failure to the corpus, so that none is lost: the first failing example is saved the
moment it fails, before Hypothesis starts shrinking it (a crash or a kill during shrinking loses nothing), and the
shrunk example replaces it once the search ends. A corpus that cannot be written raises nothing: the report then
shows the whole trace."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from kvfuzz.scheduler.engines import installed_version
from kvfuzz.scheduler.program import Operation
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.trace import RecordedFailure, SchedulerTrace, save
from kvfuzz.trace_saving import SavedTrace, save_or_keep


def vllm_version() -> str:
    """The installed vLLM's version (without importing it)."""
    return installed_version("vllm")


def save_scheduler_trace(trace: SchedulerTrace, directory: Path) -> SavedTrace[SchedulerTrace]:
    """``trace`` saved in ``directory``; a corpus that cannot be written raises nothing (the result carries the
    error and the trace)."""
    return save_or_keep(trace, directory, save)


class FailureRecorder:
    """The search's witness (:data:`kvfuzz.scheduler.machine.Witness`): saves the first failing example at once and
    keeps the latest (Hypothesis replays the shrunk example last); :meth:`finish` saves that one."""

    def __init__(self, scheduler: str, directory: Path) -> None:
        self.scheduler = scheduler  # the target's name (``--scheduler``)
        self.directory = directory  # the corpus
        self.first: Optional[SavedTrace[SchedulerTrace]] = None  # the unshrunk trace, saved when found
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

    def finish(self, failure: Optional[BaseException], shrunk: bool) -> Optional[SavedTrace[SchedulerTrace]]:
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
