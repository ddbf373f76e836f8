"""Isolation, one stage for every target: what a target runs in a child process, so that a crash that kills the
process (a segfault in an allocator or a native extension, an abort, ``os._exit``) or a hang no interrupt reaches
(a loop in C code) ends the child, never the command or the campaign, as libFuzzer's fork mode does.

:func:`run_in_child` starts the child in a process group of its own (the parent alone receives the terminal's
Ctrl-C), tied to the parent (:mod:`kvfuzz.lifeline`: it never outlives it), waits for what the body returns (sent
back pickled), and otherwise says how the child ended. What a target gives is data: the body; the start method (a
fresh interpreter, ``spawn``, where nothing of the parent's torch threads or locks may leak into the child; ``fork``
where the engine imported already makes a child cost milliseconds instead of seconds); what the child does once
orphaned (:class:`Orphaned`); the journal that is its heartbeat, and the patience after which a child whose journal
has not moved is taken for hung past the watchdog's interrupts and killed; and the stop signals the caller received
(a list :func:`~kvfuzz.program.safeguards.deferred_interrupts` fills), each forwarded to the child once, the child
killed with its process group :data:`STOP_GRACE` seconds after the first. A child killed after a stop is
:class:`Stopped` (the user's doing, never a finding); one that ends otherwise without a result :class:`Ended`, and the
target turns the program its journal holds into a trace of its own (:mod:`kvfuzz.saved.journals`'s reader).

The child is never left running: on any exception in the parent (Ctrl-C that the caller did not defer included) it
is killed, with its process group, before the exception goes on. kvfuzz's own failure in the child
(:class:`~kvfuzz.scheduler.harness.HarnessError`) is sent back and raised in the parent: a harness error, never a
death."""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Generic, Optional, Sequence, TypeVar

import attrs

from kvfuzz.lifeline import tie_to_parent
from kvfuzz.program.safeguards import STOP_SIGNALS, deferred_interrupts, journal_path
from kvfuzz.scheduler.harness import HarnessError

T = TypeVar("T")

STOP_GRACE = 10.0
"""Seconds a child has to stop after the parent forwarded it a stop signal (Ctrl-C, SIGTERM, SIGHUP) before the
parent kills its process group (SIGKILL): a target that ignores the signals never keeps the command, nor itself,
alive."""

LOOK = 0.2
"""Seconds between two looks at the child (and the most a result waits in the pipe before it is read)."""

EXIT_GRACE = 5.0
"""Seconds a child that sent its result has to exit (flushing its output, closing its journal) before it is
killed."""


@attrs.frozen
class Orphaned:
    """What a child does once its parent is gone (nobody is left to report what it finds): the signal it sends
    itself at once (SIGTERM: stop as on Ctrl-C; SIGKILL: end now), and ``grace`` seconds later, before it ends, the
    journal of its own in ``journal_dir`` it removes (None: none), so that it is never taken for a process the
    target killed."""

    signal: int
    grace: float = 0.0
    journal_dir: Optional[Path] = None


@attrs.frozen
class Returned(Generic[T]):
    """The child returned ``value``."""

    value: T


@attrs.frozen
class Ended:
    """The child ended without a result: ``code`` its exit code (negative: the signal that killed it; None: not
    known), ``how`` for a person ("was killed by signal 11 (SIGSEGV)", "exited with status 3", "hung: ...")."""

    pid: int
    code: Optional[int]
    how: str

    @property
    def by_signal(self) -> bool:
        """Whether a signal ended it (the parent's kill of a hung child included)."""
        return self.code is not None and self.code < 0

    def told(self) -> str:
        """How it ended, for a person, saying that an exit had no result (a signal needs no saying)."""
        return self.how if self.by_signal else f"{self.how} without a result"


@attrs.frozen
class Stopped:
    """A stop signal the parent forwarded ended the child before it had a result: the user's doing."""

    pid: int
    signal: int  # the first signal the parent received


def run_in_child(
    body: Callable[[], T],
    start_method: str,
    orphaned: Orphaned,
    heartbeat: Optional[Path] = None,
    patience: Optional[float] = None,
    stops: Sequence[int] = (),
    tick: Callable[[], None] = lambda: None,
) -> Returned[T] | Ended | Stopped:
    """``body()`` in a child started by ``start_method`` (``spawn``: ``body`` must pickle), see the module: what it
    returned, or how it ended. ``heartbeat``: the file whose changes say the child is alive (its journal), watched
    when ``patience`` (seconds) is given; ``stops``: the stop signals the caller receives meanwhile (a list that grows);
    ``tick`` is called at every look at the child."""
    context: Any = multiprocessing.get_context(start_method)  # spawn's or fork's: both have Process
    receiving, sending = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(body, sending, os.getpid(), orphaned), name="kvfuzz-isolated")
    started = time.monotonic()
    child.start()
    sending.close()
    pid = child.pid
    assert pid is not None  # started
    forwarded = 0
    kill_at: Optional[float] = None
    closed = False  # the pipe's end was read: nothing more will come
    try:
        while True:
            tick()
            for signum in stops[forwarded:]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            forwarded = len(stops)
            if stops and kill_at is None:
                kill_at = time.monotonic() + STOP_GRACE
            if kill_at is not None and time.monotonic() > kill_at:
                _kill_group(pid)  # it ignored the stop: it and whatever it started end now
                kill_at = float("inf")
            if not closed and receiving.poll(LOOK):
                try:
                    value = receiving.recv()
                except EOFError:
                    closed = True  # it died while sending, or before: its exit code says how
                else:
                    child.join(EXIT_GRACE)  # it is on its way out: let it finish
                    if isinstance(value, HarnessError):
                        raise value  # kvfuzz's own code failed in the child: the command ends on it
                    return Returned(value)
            if closed:
                time.sleep(LOOK)  # a child that closed its end without a result: wait for its exit
            if not child.is_alive() and (closed or not receiving.poll(0)):  # gone, and nothing it sent left to read
                child.join()
                return _ended(pid, child.exitcode, stops)
            if patience is not None and time.monotonic() - max(started, _modified(heartbeat)) > patience:
                _kill_group(pid)
                child.join()
                hung = f"hung: no operation for {patience:.0f} s (past the watchdog's interrupts), killed"
                return Ended(pid, child.exitcode, hung)
    finally:
        if child.is_alive():
            _kill_group(pid)
        child.join()
        receiving.close()


def _ended(pid: int, code: Optional[int], stops: Sequence[int]) -> Ended | Stopped:
    if stops and (code is None or code >= 0 or -code in STOP_SIGNALS or -code == signal.SIGKILL):
        return Stopped(pid, stops[0])
    if code is not None and code < 0:
        return Ended(pid, code, f"was killed by signal {-code} ({signal.Signals(-code).name})")
    return Ended(pid, code, f"exited with status {code}")


def _kill_group(pid: int) -> None:
    """SIGKILL to the child's process group (it and whatever it started), or the child alone if it has none yet."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _modified(path: Optional[Path]) -> float:
    """When ``path`` last changed, on the monotonic clock (0 when there is none)."""
    if path is None:
        return 0.0
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return 0.0
    return time.monotonic() - age


def _child(body: Callable[[], object], sending: Connection, parent: int, orphaned: Orphaned) -> None:
    """The child: its own process group, tied to its parent, ``body``'s result (or kvfuzz's own failure) sent back."""
    os.setpgid(0, 0)  # the parent alone gets the terminal's signals, and forwards them
    journal = journal_path(orphaned.journal_dir) if orphaned.journal_dir is not None else None
    tie_to_parent(
        parent,
        lambda: os.kill(os.getpid(), orphaned.signal),
        orphaned.grace,
        lambda: journal.unlink(missing_ok=True) if journal is not None else None,
    )
    with contextlib.suppress(AttributeError, ValueError, OSError):
        faulthandler.enable()  # where the target killed the child, on the standard error it shares
    try:
        result = body()
    except HarnessError as error:  # kvfuzz's own failure: sent back, for the parent to raise, never a death
        result = error
    with deferred_interrupts(), contextlib.suppress(BrokenPipeError):  # broken: the parent is gone, nobody to tell
        sending.send(result)
