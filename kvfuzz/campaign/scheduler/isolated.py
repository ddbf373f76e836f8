"""The scheduler targets on the one isolation stage (:mod:`kvfuzz.isolation`): a scheduler campaign's batches
(``kvfuzz campaign --scheduler NAME --isolate``) and ``kvfuzz run --scheduler NAME --isolate``'s examples in child
processes, so that a crash that kills the process (a segfault in a native extension, an abort) or a hang that no
interrupt reaches (a loop in C code) ends the child, never the campaign, and the program the child was running is
kept as a scheduler trace.

What the scheduler targets give the stage: a child forked from the process, which has imported the engine already
(vLLM, or SGLang; a fork costs milliseconds; a fresh interpreter would import it again, seconds per batch); the
running example's program kept in the journal every target writes (:class:`kvfuzz.program.safeguards.Journal`, at its
parent's path), which doubles as its heartbeat, the child killed once it has not moved for twice the call timeout and
ten seconds (:func:`~kvfuzz.campaign.process.patience_of`); an orphaned child ends at once. The child runs the batch
as the campaign would in its own process (:func:`~kvfuzz.campaign.scheduler.loop.run_batch`, with the watchdog that
turns a step past ``--call-timeout`` into a hang finding). A child that ends without a result leaves its journal,
which becomes a trace whose failure is ``crash (SchedulerProcessDied)``: not shrunk, since every replay would kill the
process again.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, Callable, Generic, Optional, TypeVar

import attrs

from kvfuzz.campaign.process import patience_of
from kvfuzz.campaign.scheduler.loop import BatchPlan, BatchResult, IsNew, Runner, SchedulerCampaignOptions, run_batch
from kvfuzz.campaign.scheduler.target import SchedulerProcessDied, SchedulerTarget
from kvfuzz.isolation import Ended, Orphaned, Returned, Stopped, run_in_child
from kvfuzz.program.safeguards import Journal, journal_path
from kvfuzz.saved.journals import last_program
from kvfuzz.scheduler.recorder import save_scheduler_trace
from kvfuzz.scheduler.search import Outcome
from kvfuzz.scheduler.signature import scheduler_signature
from kvfuzz.scheduler.trace import SchedulerTrace, SchedulerTraceError, from_journal

T = TypeVar("T")


def isolated_runner(
    target: SchedulerTarget, options: SchedulerCampaignOptions, tick: Callable[[], None] = lambda: None
) -> Runner:
    """A batch runner that runs each batch in a child process (see the module); ``tick`` is called every fifth of a
    second while a child runs (a campaign worker's heartbeat)."""
    journal = journal_path(options.corpus)

    def run(plan: BatchPlan, is_new: IsNew) -> BatchResult:
        options.corpus.mkdir(parents=True, exist_ok=True)
        try:
            return _run_child(target, options, plan, is_new, journal, tick)
        finally:
            journal.unlink(missing_ok=True)

    return run


def _run_child(
    target: SchedulerTarget,
    options: SchedulerCampaignOptions,
    plan: BatchPlan,
    is_new: IsNew,
    journal: Path,
    tick: Callable[[], None],
) -> BatchResult:
    body: Callable[[Journal], BatchResult] = lambda kept: run_batch(target, options, plan, is_new, kept)  # noqa: E731
    ended = run_watched(body, journal, journal_target(target.name, target.version()), options.call_timeout, tick)
    if not isinstance(ended, Returned):
        return _death(target, options, plan, is_new, journal, ended.told())
    result: BatchResult = ended.value
    return result


def journal_target(scheduler: str, version: str) -> dict[str, Any]:
    """What every header of a scheduler target's journal names: the scheduler, and the engine's version."""
    return {"scheduler": scheduler, "version": version}


def run_watched(
    body: Callable[[Journal], T],
    journal: Path,
    header: dict[str, Any],
    call_timeout: Optional[float],
    tick: Callable[[], None] = lambda: None,
) -> Returned[T] | Ended:
    """``body(journal)`` in a child forked from this process (``journal`` a :class:`Journal` at that path, whose
    headers name ``header``), on the isolation stage: what it returned, or how it ended. A child whose journal has
    not moved for :func:`patience_of` ``call_timeout`` is taken for hung past the watchdog's interrupts and killed;
    Ctrl-C here is raised, the child killed first."""
    journal.unlink(missing_ok=True)
    ended = run_in_child(
        _Journalled(body, journal, header),
        "fork",
        Orphaned(signal.SIGKILL),
        heartbeat=journal,
        patience=patience_of(call_timeout),
        tick=tick,
    )
    assert not isinstance(ended, Stopped)  # no stop is forwarded to it: Ctrl-C is raised here
    return ended


@attrs.frozen
class _Journalled(Generic[T]):
    """A child's body, ``body`` with a journal at ``path`` whose headers name ``header``: what it ran is in its result,
    and the journal goes with it (an exception of kvfuzz's leaves the journal: the parent keeps it)."""

    body: Callable[[Journal], T]
    path: Path
    header: dict[str, Any]

    def __call__(self) -> T:
        journal = Journal(self.path.parent, self.header, {}, self.path)
        result = self.body(journal)
        journal.close()
        return result


def _death(
    target: SchedulerTarget,
    options: SchedulerCampaignOptions,
    plan: BatchPlan,
    is_new: IsNew,
    journal: Path,
    how: str,
) -> BatchResult:
    """A child ended without a result: the program its journal held, as a finding."""
    message = f"the process running the batch {how}"
    failure = SchedulerProcessDied(message)
    signature = scheduler_signature(target.name, failure)
    outcome = Outcome(plan.config.setup, 0, 0, 0, 0, 0.0, failure, "")
    trace = died_trace(journal, message)
    if not is_new(signature, None):  # counted where it is known from
        return BatchResult(outcome, signature, None)
    if trace is None:
        return BatchResult(outcome, signature, None, note=f"{message}; its program is lost (no journal)", new=True)
    saved = save_scheduler_trace(trace, options.corpus)
    note = f"{message}: not shrunk (every replay would kill the process)"
    return BatchResult(outcome, signature, saved, saved=saved, note=note, new=True)


def died_trace(journal: Path, message: str) -> Optional[SchedulerTrace]:
    """The trace of a process that died running the program ``journal`` holds (None: no journal, or none that
    becomes a trace), against the scheduler and engine version its header names: its failure a crash
    (:data:`~kvfuzz.scheduler.trace.PROCESS_DIED`) told by ``message``, not shrunk, since every replay would kill the
    process again."""
    try:
        header, calls = last_program(journal)
    except OSError:  # no journal (NotAJournal among them)
        return None
    if header is None or "config" not in header:
        return None
    try:
        return from_journal(header, calls, message)
    except SchedulerTraceError:
        return None
