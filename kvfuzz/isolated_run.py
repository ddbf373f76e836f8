"""The allocator target's isolated run (``kvfuzz run --isolate``, the plugin's ``--kvfuzz-isolate``), on the one
isolation stage (:mod:`kvfuzz.isolation`): a segfault, an abort or a kill in the allocator ends the child, never the
run, and the parent reports that death with the program the child's journal recorded, saved as a trace.

What the allocator target gives the stage: a fresh interpreter (``spawn``: nothing of the parent's torch threads or
locks); the terminal's Ctrl-C and the signals ``timeout`` sends forwarded to the child, which stops with what it
found, as a run in one process does; an orphaned child stops as on Ctrl-C and, :data:`ORPHAN_GRACE` seconds later,
removes its journal. The child sends back the run's summary and, on failure, the trace to save (the summary's
exception stays behind: its class is not always importable); the parent prints and saves both, as without
isolation. A death becomes a trace through the journals' one recovery (:mod:`kvfuzz.saved.journals`).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Optional, Union

import attrs

from kvfuzz.campaign.store import open_examples
from kvfuzz.engine.config import MachineConfig
from kvfuzz.isolation import Ended, Orphaned, Returned, Stopped, run_in_child
from kvfuzz.program.call import program_text
from kvfuzz.program.safeguards import (
    DEFAULT_CALL_TIMEOUT,
    deferred_interrupts,
    exits_as_crashes,
    journal_path,
)
from kvfuzz.registry import load_factory
from kvfuzz.runner import RunSummary, run
from kvfuzz.saved import journals
from kvfuzz.saved.corpus import PROCESS_DIED, HangSaver, trace_of
from kvfuzz.saved.trace import Trace, TraceError, load
from kvfuzz.text import plural
from kvfuzz.trace_saving import replay_hint, show_hint


@attrs.frozen
class RunRequest:
    """One run, as the child is told it: plain values only (they cross into a fresh interpreter)."""

    allocator: str  # the spec the child loads the factory from
    config: MachineConfig
    examples: int
    steps: int
    seed: Optional[int] = None
    derandomize: Optional[bool] = None
    shrink: bool = True
    database: Optional[str] = None  # the example database: a directory, or redis://HOST:PORT/N
    call_timeout: Optional[float] = DEFAULT_CALL_TIMEOUT
    journal_dir: Optional[Path] = None  # where the child keeps its journal; None: a death loses the program
    progress: bool = False  # the child prints progress lines on standard error


@attrs.frozen
class Finished:
    """The child ran to the end (a failure, an interrupt or a pass): its summary, without the failure's exception,
    and the failure's trace, not saved yet (a hang, saved as found already, is saved again shrunk)."""

    summary: RunSummary
    trace: Optional[Trace]
    hang_as_found: Optional[Path] = None  # where the child saved a hang as soon as it found it


@attrs.frozen
class Died:
    """The child ended without a result. ``killed`` says whether the allocator ended it, as far as kvfuzz can tell:
    a signal killed it, or it exited (with any status, 0 included) while an example ran, which its journal left
    behind shows; a child that exited with no journal left ended outside the allocator's calls (kvfuzz's own
    failure). ``trace`` is the program its journal recorded, saved at ``path``; ``message`` says where, or why there is
    none."""

    pid: int
    how: str  # "was killed by signal 11 (SIGSEGV)", "exited with status 3"
    killed: bool
    trace: Optional[Trace]
    path: Optional[Path]
    message: str

    def program(self, machine_name: str) -> Optional[str]:
        """The program its journal held, printed as a run prints one."""
        return program_text(machine_name, self.trace.program) if self.trace is not None else None

    def describe(self, machine_name: str) -> str:
        """For a person: how the child died, the program its journal held and where it is saved, or why it is not."""
        if not self.killed:
            return f"the isolated run (pid {self.pid}) {self.how} without a result; {self.message}"
        lines = [f"{PROCESS_DIED}: the isolated run (pid {self.pid}) {self.how}"]
        if self.trace is None or self.path is None:
            return "\n".join([*lines, f"its program is not saved: {self.message}"])
        calls = plural(len(self.trace.program), "operation")
        lines += ["", f"program ({calls}, as its journal recorded it; not shrunk: every replay kills the process):"]
        lines += [str(self.program(machine_name)), "", str(self.trace.failure.get("explanation", "")), ""]
        allocator = self.trace.allocator
        lines += [f"trace saved to {self.path}", replay_hint(self.path, allocator), show_hint(self.path, allocator)]
        return "\n".join(lines)


Outcome = Union[Finished, Died, Stopped]


ORPHAN_GRACE = 5.0
"""Seconds an orphaned child (its run is gone, SIGKILL included) has to wind down before it ends itself: nobody is
left to report what it finds, so it only removes its journal (:mod:`kvfuzz.lifeline`)."""


def run_isolated(request: RunRequest) -> Outcome:
    """Run ``request`` in a child process and wait for it; see the module. A child still alive
    :data:`~kvfuzz.isolation.STOP_GRACE` seconds after the first stop signal the run forwarded to it is killed, with
    its process group."""
    orphaned = Orphaned(signal.SIGTERM, ORPHAN_GRACE, request.journal_dir)
    with deferred_interrupts() as received:
        ended = run_in_child(_IsolatedRun(request), "spawn", orphaned, stops=received)
    if isinstance(ended, Returned):
        finished: Finished = ended.value
        return finished
    if isinstance(ended, Stopped):
        if request.journal_dir is not None:
            journal_path(request.journal_dir, ended.pid).unlink(missing_ok=True)
        return ended
    return _death(ended, request.journal_dir)


def _death(ended: Ended, journal_dir: Optional[Path]) -> Died:
    """The child ended without a result: its journal, if it left one, becomes a trace."""
    pid, killed, how = ended.pid, ended.by_signal, ended.how
    if journal_dir is None:
        lost = "it kept no journal (the corpus cannot be written): its program is lost"
        return Died(pid, how, killed, None, None, lost)
    for recovered in journals.recover(journal_dir):
        if recovered.pid == pid:  # it ended in the middle of an example: the allocator's doing, whatever its status
            if not killed:
                killed, how = True, f"{how} in the middle of an example"
            if recovered.trace is None:
                return Died(pid, how, killed, None, None, recovered.message)
            try:
                return Died(pid, how, killed, load(recovered.trace), recovered.trace, recovered.message)
            except TraceError as error:
                return Died(pid, how, killed, None, None, f"{recovered.trace}: {error}")
    return Died(pid, how, killed, None, None, "it left no journal: it ended outside the allocator's calls")


@attrs.frozen
class _IsolatedRun:
    """The child's body: a run like ``kvfuzz run``'s (it pickles: the child is a fresh interpreter)."""

    request: RunRequest

    def __call__(self) -> Finished:
        request = self.request
        hang_saver = HangSaver(
            request.allocator,
            request.config,
            request.journal_dir,  # the corpus, where it can be written
            lambda line: print(f"kvfuzz: {line}", file=sys.stderr, flush=True),
        )
        with exits_as_crashes():  # from before the allocator's module is imported, as in kvfuzz run
            summary = _run(request, hang_saver)
        trace = trace_of(summary, request.allocator, request.config)
        return Finished(attrs.evolve(summary, failure=None), trace, hang_saver.path)


def _run(request: RunRequest, hang_saver: HangSaver) -> RunSummary:
    """The child's run of ``request``."""
    return run(
        load_factory(request.allocator),
        request.config,
        examples=request.examples,
        steps=request.steps,
        seed=request.seed,
        derandomize=request.derandomize,
        allocator_name=request.allocator,
        shrink=request.shrink,
        database=open_examples(request.database, Path(request.database)) if request.database else None,
        progress=(lambda line: print(line, file=sys.stderr, flush=True)) if request.progress else None,
        call_timeout=request.call_timeout,
        journal_dir=request.journal_dir,
        on_hang=hang_saver,
    )
