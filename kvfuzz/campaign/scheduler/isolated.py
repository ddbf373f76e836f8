"""A scheduler campaign's batches in child processes (``kvfuzz campaign --scheduler NAME --isolate``): a crash that
kills the process (a segfault in a native extension, an abort) or a hang that no interrupt reaches (a loop in C
code) ends the child, never the campaign, and the program the child was running is kept as a scheduler trace.

Each batch is a child forked from the campaign, which has imported the engine already (vLLM, or SGLang; a fork costs
milliseconds; a fresh interpreter would import it again, seconds per batch). The child runs the batch as the campaign
would in its own process (:func:`~kvfuzz.campaign.scheduler.loop.run_batch`, with the watchdog that turns a step past
``--call-timeout`` into a hang finding) and sends back its result; it keeps the running example's program in the
journal every target writes (:class:`kvfuzz.program.safeguards.Journal`, at its parent's path), which doubles as its
heartbeat. A child that dies without a result, or whose journal has not moved for twice the call timeout and ten
seconds (a hang the watchdog's interrupt could not reach), is killed and its journal becomes a trace whose failure is
``crash (SchedulerProcessDied)``: not shrunk, since every replay would kill the process again. The child never
outlives the campaign (:mod:`kvfuzz.lifeline`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Generic, Optional, TypeVar

import attrs

from kvfuzz.campaign.process import patience_of
from kvfuzz.campaign.scheduler.loop import BatchPlan, BatchResult, IsNew, Runner, SchedulerCampaignOptions, run_batch
from kvfuzz.campaign.scheduler.target import SchedulerProcessDied, SchedulerTarget, scheduler_signature
from kvfuzz.lifeline import tie_to_parent
from kvfuzz.program.safeguards import Journal, journal_path
from kvfuzz.saved.journals import last_program
from kvfuzz.scheduler.harness import HarnessError
from kvfuzz.scheduler.recorder import save_scheduler_trace
from kvfuzz.scheduler.search import Outcome
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
    if isinstance(ended, Died):
        return _death(target, options, plan, is_new, journal, ended.how)
    result: BatchResult = ended.value
    return result


@attrs.frozen
class Returned(Generic[T]):
    """The child returned ``value``."""

    value: T


@attrs.frozen
class Died:
    """The child ended without a result: how, for a person (killed by a signal, exited, or hung and killed)."""

    how: str


def journal_target(scheduler: str, version: str) -> dict[str, Any]:
    """What every header of a scheduler target's journal names: the scheduler, and the engine's version."""
    return {"scheduler": scheduler, "version": version}


def run_watched(
    body: Callable[[Journal], T],
    journal: Path,
    header: dict[str, Any],
    call_timeout: Optional[float],
    tick: Callable[[], None] = lambda: None,
) -> Returned[T] | Died:
    """``body(journal)`` in a child forked from this process (``journal`` a :class:`Journal` at that path, whose
    headers name ``header``), in a process group of its own (the parent alone gets
    the terminal's Ctrl-C) and tied to this process: what it returned (sent back pickled), or how it died. A child
    whose journal (its heartbeat) has not moved for :func:`patience_of` ``call_timeout`` is taken for hung past the
    watchdog's interrupts and killed. The child is never left running: on any exception here (Ctrl-C included) it
    is killed before the exception goes on. ``tick`` is called at every look at the child (a fifth of a second)."""
    context = multiprocessing.get_context("fork")
    receiving, sending = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(body, journal, header, sending, os.getpid()), name="kvfuzz-isolated")
    journal.unlink(missing_ok=True)
    started = time.monotonic()
    child.start()
    sending.close()
    patience = patience_of(call_timeout)
    try:
        while True:
            tick()
            if receiving.poll(0.2):
                try:
                    value: T = receiving.recv()
                except EOFError:
                    pass  # it died while sending, or before: its exit code says how
                else:
                    if isinstance(value, HarnessError):
                        raise value  # kvfuzz's own code failed in the child: the campaign ends on it
                    return Returned(value)
            if not child.is_alive():
                child.join()
                code = child.exitcode
                if code and code < 0:
                    return Died(f"was killed by signal {-code} ({signal.Signals(-code).name})")
                return Died(f"exited with status {code} without a result")
            if time.monotonic() - max(started, _modified(journal)) > patience:
                return Died(f"hung: no operation for {patience:.0f} s (past the watchdog's interrupts), killed")
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receiving.close()


def _modified(path: Path) -> float:
    """When ``path`` last changed, on the monotonic clock (0 when it does not exist)."""
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return 0.0
    return time.monotonic() - age


def _child(
    body: Callable[[Journal], object], path: Path, header: dict[str, Any], sending: Connection, parent: int
) -> None:
    os.setpgid(0, 0)  # the parent alone gets the terminal's Ctrl-C, and ends the child itself
    tie_to_parent(parent, lambda: os.kill(os.getpid(), signal.SIGKILL), 0.0)
    journal = Journal(path.parent, header, {}, path)
    try:
        result = body(journal)
    except HarnessError as error:  # kvfuzz's own failure: sent back, for the campaign to end on, never a death
        result = error
    journal.close()  # what ran is in the result (an exception of kvfuzz's leaves the journal: the parent keeps it)
    with contextlib.suppress(BrokenPipeError):
        sending.send(result)


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
    if trace is None:
        return BatchResult(outcome, signature, None, note=f"{message}; its program is lost (no journal)")
    if not is_new(signature, None):
        return BatchResult(outcome, signature, None)
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
