"""A run whose allocator runs in a child process (``kvfuzz run --isolate``, the plugin's ``--kvfuzz-isolate``), as
libFuzzer's fork mode does: a segfault, an abort or a kill in the allocator ends the child, never the run, and the
parent reports that death with the program the child's journal recorded, saved as a trace.

The child is a fresh interpreter (multiprocessing's ``spawn``: nothing of the parent's torch threads or locks) in a
process group of its own, so the parent alone receives the terminal's Ctrl-C and the signals ``timeout`` sends, and
forwards each to the child once; the child stops with what it found, as a run in one process does. The child never
outlives the parent (:mod:`kvfuzz.lifeline`). It sends back the run's summary and, on failure, the trace to save
(the summary's exception stays behind: its class is not always importable); the parent prints and saves both, as
without isolation.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Optional, Union

import attrs

from kvfuzz.campaign.store import open_examples
from kvfuzz.engine.config import MachineConfig
from kvfuzz.lifeline import tie_to_parent
from kvfuzz.program.call import program_text
from kvfuzz.program.safeguards import (
    DEFAULT_CALL_TIMEOUT,
    STOP_SIGNALS,
    deferred_interrupts,
    exits_as_crashes,
    journal_path,
)
from kvfuzz.registry import load_factory
from kvfuzz.runner import RunSummary, run
from kvfuzz.saved import journals
from kvfuzz.saved.corpus import PROCESS_DIED, HangSaver, trace_of
from kvfuzz.saved.hint import replay_hint, show_hint
from kvfuzz.saved.trace import Trace, TraceError, load
from kvfuzz.text import plural


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


@attrs.frozen
class Stopped:
    """Ctrl-C, SIGTERM or SIGHUP reached the child before it had a result (while it started, say) and ended it: the
    user's doing, never the allocator's; nothing was found, and its journal, if any, is removed."""

    pid: int
    signal: int  # the first signal the run received


Outcome = Union[Finished, Died, Stopped]


STOP_GRACE = 10.0
"""Seconds a child has to stop after the run forwarded it a stop signal (Ctrl-C, SIGTERM, SIGHUP) before the run
kills its process group (SIGKILL): an allocator that ignores the signals never keeps the run, nor itself, alive."""

ORPHAN_GRACE = 5.0
"""Seconds an orphaned child (its run is gone, SIGKILL included) has to wind down before it ends itself: nobody is
left to report what it finds, so it only removes its journal (:mod:`kvfuzz.lifeline`)."""


def run_isolated(request: RunRequest) -> Outcome:
    """Run ``request`` in a child process and wait for it; see the module. A child still alive :data:`STOP_GRACE`
    seconds after the first stop signal the run forwarded to it is killed, with its process group."""
    context = multiprocessing.get_context("spawn")
    receiving, sending = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(request, sending, os.getpid()), name="kvfuzz-isolated")
    result: Optional[Finished] = None
    with deferred_interrupts() as received:
        child.start()
        sending.close()
        pid = child.pid
        assert pid is not None  # started
        forwarded = 0
        kill_at: Optional[float] = None
        while result is None and (child.is_alive() or receiving.poll(0)):
            for signum in received[forwarded:]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            forwarded = len(received)
            if received and kill_at is None:
                kill_at = time.monotonic() + STOP_GRACE
            if kill_at is not None and time.monotonic() > kill_at:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)  # it ignored the stop: it and whatever it started end now
                kill_at = float("inf")
            if receiving.poll(0.1):
                try:
                    result = receiving.recv()
                except EOFError:
                    break
        child.join()
    receiving.close()
    if result is not None:
        return result
    code = child.exitcode
    if received and (code is None or code >= 0 or -code in STOP_SIGNALS):
        if request.journal_dir is not None:
            journal_path(request.journal_dir, pid).unlink(missing_ok=True)
        return Stopped(pid, received[0])
    return _death(pid, code, request.journal_dir)


def _death(pid: int, code: Optional[int], journal_dir: Optional[Path]) -> Died:
    """The child ``pid`` ended with ``code`` and no result: its journal, if it left one, becomes a trace."""
    if code is not None and code < 0:
        killed, how = True, f"was killed by signal {-code} ({signal.Signals(-code).name})"
    else:
        killed, how = False, f"exited with status {code}"
    if journal_dir is None:
        lost = "it kept no journal (the corpus cannot be written): its program is lost"
        return Died(pid, how, killed, None, None, lost)
    for recovered in journals.recover(journal_dir):
        if recovered.pid == pid:  # it ended in the middle of an example: the allocator's doing, whatever its status
            if not killed:
                killed, how = True, f"exited with status {code} in the middle of an example"
            if recovered.trace is None:
                return Died(pid, how, killed, None, None, recovered.message)
            try:
                return Died(pid, how, killed, load(recovered.trace), recovered.trace, recovered.message)
            except TraceError as error:
                return Died(pid, how, killed, None, None, f"{recovered.trace}: {error}")
    return Died(pid, how, killed, None, None, "it left no journal: it ended outside the allocator's calls")


def _child(request: RunRequest, sending: Connection, parent: int) -> None:
    """The child: a run like ``kvfuzz run``'s, its summary and trace sent to the parent."""
    os.setpgid(0, 0)  # the parent alone gets the terminal's signals, and forwards them
    journal = journal_path(request.journal_dir) if request.journal_dir is not None else None
    tie_to_parent(
        parent,
        lambda: os.kill(os.getpid(), signal.SIGTERM),  # stop as on Ctrl-C
        ORPHAN_GRACE,
        lambda: journal.unlink(missing_ok=True) if journal is not None else None,
    )
    with contextlib.suppress(AttributeError, ValueError, OSError):
        faulthandler.enable()  # where the allocator killed the child, on the standard error it shares
    hang_saver = HangSaver(
        request.allocator,
        request.config,
        request.journal_dir,  # the corpus, where it can be written
        lambda line: print(f"kvfuzz: {line}", file=sys.stderr, flush=True),
    )
    with exits_as_crashes():  # from before the allocator's module is imported, as in kvfuzz run
        summary = _run(request, hang_saver)
    trace = trace_of(summary, request.allocator, request.config)
    with deferred_interrupts(), contextlib.suppress(BrokenPipeError):  # broken: the parent is gone, nobody to tell
        sending.send(Finished(attrs.evolve(summary, failure=None), trace, hang_saver.path))


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
