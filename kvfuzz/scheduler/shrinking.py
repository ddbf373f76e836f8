"""A scheduler failure that Hypothesis did not shrink, shrunk by deleting operations under its signature: the pass
every target shares (:func:`kvfuzz.shrink.deletion.delete_operations`) over the scheduler's program
(:class:`kvfuzz.scheduler.deletions.SchedulerDeletions`), each candidate replayed with every check.

Two failures need it: a mutant's (a guided campaign's program, no Hypothesis example to shrink), and one whose
shrinking by Hypothesis drifted to another failure (Hypothesis shrinks towards whatever fails, where a candidate
failing with another signature is not what this finding needs), in a campaign's batch or in ``kvfuzz run``. A
candidate is kept only when its replay fails with the finding's signature, so the shrunk trace is the same finding,
in fewer operations; the passes repeat until none deletes anything or :data:`SHRINK_SECONDS` (or the campaign's end)
runs out.

Invariant: the trace saved for the finding always fails with its signature: the shrunk one replaces the one found
only once it is written (:func:`shrink_saved`), and a stop (Ctrl-C) while shrinking leaves the one found.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import attrs

from kvfuzz.scheduler.deletions import SchedulerDeletions
from kvfuzz.scheduler.program import Operation
from kvfuzz.scheduler.recorder import save_scheduler_trace
from kvfuzz.scheduler.replay import ReplayRefused
from kvfuzz.scheduler.replay_result import SchedulerReplay
from kvfuzz.scheduler.signature import scheduler_signature
from kvfuzz.scheduler.trace import RecordedFailure, SchedulerTrace, SchedulerTraceError, program_from_json
from kvfuzz.shrink.deletion import delete_operations
from kvfuzz.shrink.signature import Signature
from kvfuzz.text import plural
from kvfuzz.trace_saving import SavedTrace

SHRINK_SECONDS = 10.0
"""The most a failure's shrinking by deletion takes (each candidate is one replay: a scheduler built and driven)."""


@attrs.frozen
class Shrunk:
    """What a shrink by deletion kept: the shortest trace that failed with the signature (the one given, when no
    shorter one did) and what its replay raised (None: the one given was kept), the replays it took, and why it
    stopped short of its fixpoint (None: it reached it)."""

    trace: SchedulerTrace
    error: Optional[Exception]
    replays: int
    stopped: Optional[str]

    def describe(self, before: int) -> str:
        """For a person, given the operations the trace had before."""
        after = len(self.trace.program)
        kept = (
            f"shrunk by deleting operations, from {plural(before, 'operation')} to {after}"
            if after < before
            else f"no operation of its {before} could be deleted"
        )
        stopped = f", stopped when {self.stopped}" if self.stopped else ""
        return f"{kept} ({plural(self.replays, 'replay')}{stopped})"


def shrink_trace(
    trace: SchedulerTrace,
    signature: Signature,
    replay: Callable[[SchedulerTrace], SchedulerReplay],
    deadline: Optional[float] = None,
    seconds: float = SHRINK_SECONDS,
) -> Shrunk:
    """``trace`` shrunk by deleting operations (see the module): each candidate replayed by ``replay`` and kept when
    it fails with ``signature``; within ``seconds``, and never past ``deadline`` (``time.monotonic()``; None: none).
    A candidate the engine refuses, or the trace format does not take, is not kept."""
    ends = time.monotonic() + seconds
    if deadline is not None:
        ends = min(ends, deadline)

    def out_of_time() -> bool:
        return time.monotonic() >= ends

    candidates = _Candidates(trace, signature, replay)
    current = list(trace.program)
    while not out_of_time():
        shorter = delete_operations(current, SchedulerDeletions(candidates.fails), out_of_time)
        if len(shorter) == len(current):
            break
        current = shorter
    stopped = f"its time bound ({seconds:g} s) or the campaign's end came" if out_of_time() else None
    return Shrunk(candidates.kept, candidates.error, candidates.replays, stopped)


class _Candidates:
    """One shrink's candidates: each replayed, and the last that failed with the signature kept."""

    def __init__(
        self, trace: SchedulerTrace, signature: Signature, replay: Callable[[SchedulerTrace], SchedulerReplay]
    ) -> None:
        self.signature = signature
        self.replay = replay
        self.kept = trace  # the shortest trace that failed with the signature so far
        self.error: Optional[Exception] = None  # what its replay raised (None: the trace given is kept)
        self.replays = 0  # candidates replayed

    def fails(self, candidate: list[Operation]) -> bool:
        """Whether ``candidate`` fails with the signature (then it is kept, with the failure its replay recorded)."""
        try:
            program = program_from_json([operation.to_json() for operation in candidate], self.kept.setup)
        except SchedulerTraceError:
            return False
        tried = attrs.evolve(self.kept, program=program)
        self.replays += 1
        try:
            replayed = self.replay(tried)
        except ReplayRefused:
            return False
        if replayed.error is None or scheduler_signature(tried.scheduler, replayed.error) != self.signature:
            return False
        self.kept = attrs.evolve(tried, failure=RecordedFailure.of(replayed.error), shrunk=True)
        self.error = replayed.error
        return True


def shrink_saved(
    found: SavedTrace[SchedulerTrace],
    signature: Signature,
    replay: Callable[[SchedulerTrace], SchedulerReplay],
    deadline: Optional[float],
) -> tuple[SavedTrace[SchedulerTrace], str, Optional[Exception]]:
    """The trace ``found`` (saved as found) shrunk by deletion and saved in its corpus, the one found then removed;
    with a note for the finding, and what the shrunk trace's replay raised (None: the one found stays, when nothing
    shorter failed or the shorter one could not be written). A stop (Ctrl-C) while shrinking raises, the one found
    left as it is."""
    before = len(found.trace.program)
    shrunk = shrink_trace(found.trace, signature, replay, deadline)
    note = shrunk.describe(before)
    if shrunk.error is None:
        return found, note, None
    saved = save_scheduler_trace(shrunk.trace, found.path.parent)
    if saved.error is not None:
        return found, f"{note}; the shrunk trace could not be saved ({saved.error}): the trace is the one found", None
    if found.written and found.path != saved.path:
        found.path.unlink(missing_ok=True)
    return saved, note, shrunk.error


def confirm(
    trace: SchedulerTrace, signature: Signature, replay: Callable[[SchedulerTrace], SchedulerReplay]
) -> tuple[Optional[int], Optional[str]]:
    """One replay of ``trace``, the trace a finding names: 1 when it fails with ``signature``; 0 when it does not,
    with what it found; None when the engine refuses it, with why."""
    try:
        replayed = replay(trace)
    except ReplayRefused as refused:
        return None, f"not confirmed by a replay: {refused}"
    if replayed.error is not None and scheduler_signature(trace.scheduler, replayed.error) == signature:
        return 1, None
    return 0, f"the trace's replay found: {replayed.describe_failure()}"


def shrink_drifted(
    first: Optional[SavedTrace[SchedulerTrace]],
    reported: Optional[SavedTrace[SchedulerTrace]],
    replay: Callable[[SchedulerTrace], SchedulerReplay],
) -> Optional[str]:
    """A run's failure found first (``first``, saved as found) when it is not the one the run reports (``reported``:
    Hypothesis's shrinking ended on another): its trace shrunk by deletion under its own signature, and one line for
    a person saying so and where it is; None when the run reports the failure it found first (the same file: the
    shrunk example may be the one found), or that trace is gone (the shrunk one replaced it) or was never written."""
    if first is None or reported is None or first.error is not None or first.path == reported.path:
        return None
    if not first.path.exists():
        return None
    head = f"kvfuzz: the failure found first ({first.trace.failure.check}) is not the one reported"
    try:
        found = replay(first.trace)
    except ReplayRefused as refused:
        return f"{head}; its unshrunk trace is kept: {first.path} (its replay was refused: {refused})"
    if found.error is None or not found.reproduced:
        return f"{head}; its unshrunk trace is kept: {first.path} (its replay found: {found.describe_failure()})"
    saved, note, _ = shrink_saved(first, scheduler_signature(first.trace.scheduler, found.error), replay, None)
    return f"{head}; its trace, {note}: {saved.path}"
