"""What keeps a failure from being lost or invented while an allocator misbehaves: the user's Ctrl-C told apart from
an allocator's exceptions, a watchdog for calls that never return, and an append-only journal of the program being
run, for a process the allocator kills.

* :class:`UserInterrupt`: while :func:`user_interrupts` is active, SIGINT raises this ``KeyboardInterrupt``; any other
  ``BaseException`` that escapes an allocator call (``SystemExit``, a ``KeyboardInterrupt`` the user did not send,
  a test runner's skip) is the allocator's crash, :class:`AllocatorEscape`.
* :func:`exits_as_crashes`: while active, ``os._exit`` called in this process (by the allocator: kvfuzz never calls
  it) raises :class:`ProcessExit`, a ``SystemExit``, so an allocator that ends the process cleanly is a crash found
  with its program, not a run that ended with status 0.
* :class:`Watchdog`: one operation may run for at most ``seconds``; past that the main thread gets
  :class:`AllocatorHang`, a ``BaseException`` so that Hypothesis does not spend the timeout again on every shrink.
  It keeps the longest an operation took that returned in time, from which a hang's shrink takes a shorter limit
  (:meth:`Watchdog.hang_limit`).
* :class:`Journal`: the calls of the running program, flushed before each call.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import IO, Any, Iterator, Optional, TypeVar

DEFAULT_CALL_TIMEOUT = 60.0
"""Seconds one operation (the allocator's calls and kvfuzz's checks of them) may take before it is a hang."""


class UserInterrupt(KeyboardInterrupt):
    """Ctrl-C (SIGINT) from the person running kvfuzz: stop, report what was found, never blame the allocator."""


Raised = TypeVar("Raised", bound=BaseException)


class OutsideStop(BaseException):
    """A stop raised into running code from outside it (a campaign's end, its alarm): whatever the code raised as it
    unwound is no finding."""


def raise_stop_behind(error: Exception) -> None:
    """Raise the user's interrupt or an :class:`OutsideStop` that ``error`` was raised while handling
    (:func:`stop_behind`); nothing if there is none."""
    stop = stop_behind(error, (UserInterrupt, OutsideStop))
    if stop is not None:
        raise stop from None


def carried(error: BaseException, kind: type[Raised]) -> Optional[Raised]:
    """The exception of ``kind`` that ``error`` carries: itself, one of a group's exceptions, or a cause or context of
    either; None if it carries none. An interrupt raised into a search from outside (the user's, a campaign's end) may
    land while Hypothesis draws or replays an example, and come back wrapped in Hypothesis's own error (a ``Flaky``, a
    ``FlakyStrategyDefinition``): that is the interrupt, never a finding nor a harness error."""
    return next((linked for linked in _linked(error, suppressed=True) if isinstance(linked, kind)), None)


def stop_behind(error: Exception, kinds: tuple[type[BaseException], ...]) -> Optional[BaseException]:
    """The stop of one of ``kinds`` (the user's interrupt, a caller's cut-off: raised from outside) that ``error`` was
    raised while handling, through its group's exceptions, causes and unsuppressed contexts (``raise ... from None``
    ends the chain: code that turns a stop into its own report has handled it); None if none."""
    return next((linked for linked in _linked(error, suppressed=False) if isinstance(linked, kinds)), None)


def _linked(error: BaseException, suppressed: bool) -> Iterator[BaseException]:
    """``error``, then what it carries, depth first: a group's exceptions, its cause, its context (with
    ``suppressed``, a context ``raise ... from None`` hid too)."""
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        context = current.__context__ if suppressed or not current.__suppress_context__ else None
        linked = [*getattr(current, "exceptions", ()), current.__cause__, context]
        pending.extend(inner for inner in reversed(linked) if isinstance(inner, BaseException))


class AllocatorEscape(Exception):
    """A ``BaseException`` that is not an ``Exception`` escaped the allocator: a crash, reported and saved."""

    def __init__(self, original: BaseException) -> None:
        self.original = original
        super().__init__(f"{type(original).__name__} escaped the allocator: {original!r}")


class AllocatorHang(BaseException):
    """An operation did not return within the watchdog's limit: ``--call-timeout``, or while a hang is shrunk the
    shorter limit ``limit`` names."""

    def __init__(self, operation: str, seconds: float, limit: str = "--call-timeout") -> None:
        self.operation = operation
        self.seconds = seconds
        super().__init__(f"{operation} did not return within {seconds:g} s ({limit})")


_interrupts_active = False  # SIGINT raises UserInterrupt, so a plain KeyboardInterrupt is not the user's


def _raise_user_interrupt(signum: int, frame: Optional[FrameType]) -> None:
    raise UserInterrupt()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that mean the person (or their CI) wants the run to stop: never the allocator's crash."""


@contextlib.contextmanager
def user_interrupts() -> Iterator[None]:
    """While active (in the main thread), Ctrl-C (and SIGTERM, SIGHUP) raise :class:`UserInterrupt`, so the run
    stops with what it found and closes its journal; elsewhere it does nothing."""
    global _interrupts_active
    if threading.current_thread() is not threading.main_thread() or _interrupts_active:
        yield
        return
    previous = {signum: signal.signal(signum, _raise_user_interrupt) for signum in STOP_SIGNALS}
    _interrupts_active = True
    try:
        yield
    finally:
        _interrupts_active = False
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[list[int]]:
    """While active (in the main thread), Ctrl-C (and SIGTERM, SIGHUP) is recorded in the yielded list, signal
    number by signal number, instead of raised: for printing and saving a failure that must not be lost half-way,
    and for a campaign, which tells its workers to stop and waits for what they hold."""
    pressed: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield pressed
        return
    previous = {signum: signal.signal(signum, lambda signum, frame: pressed.append(signum)) for signum in STOP_SIGNALS}
    try:
        yield pressed
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class ProcessExit(SystemExit):
    """``os._exit(status)`` was called in the middle of a run: the allocator ending the process, cleanly or not."""

    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"os._exit({status}) called: the allocator ended the process")


@contextlib.contextmanager
def exits_as_crashes() -> Iterator[None]:
    """While active, ``os._exit`` in this process raises :class:`ProcessExit` (an allocator's crash, through
    :func:`escaped`); a process forked meanwhile (whose pid differs) still exits for real. An exit in C code
    (``exit()`` through ctypes, say) is beyond it: ``--isolate`` reports that one as the allocator's death."""
    real_exit = os._exit
    pid = os.getpid()

    def intercepted(status: int) -> Any:
        if os.getpid() != pid:
            real_exit(status)
        raise ProcessExit(status)

    os._exit = intercepted
    try:
        yield
    finally:
        os._exit = real_exit


def escaped(error: BaseException) -> BaseException:
    """What an exception leaving an allocator operation means: the user's interrupt, a stop from outside and a hang
    pass through; any other non-``Exception`` (``SystemExit``, ``GeneratorExit``, a test runner's outcome; a
    ``KeyboardInterrupt`` only while SIGINT is ours) becomes :class:`AllocatorEscape`."""
    if isinstance(error, (Exception, UserInterrupt, OutsideStop, AllocatorHang)):
        return error
    if isinstance(error, KeyboardInterrupt) and not _interrupts_active:
        return error
    return AllocatorEscape(error)


HANG_FACTOR = 20.0
"""A hang's shrink stops a candidate's operation once it has run this many times longer than the slowest operation
that returned so far (:meth:`Watchdog.hang_limit`)."""

HANG_FLOOR = 1.0
"""Seconds: the shortest limit a hang's shrink stops a candidate's operation at, however fast the calls were."""


class Watchdog:
    """Interrupts an operation that runs past ``seconds``: a daemon thread watches the running operation's deadline
    and, once it has passed, signals the main thread (SIGUSR1) every tenth of a second until the operation ends;
    the handler raises :class:`AllocatorHang` whenever the running operation is past its deadline, so an allocator
    that swallows one is interrupted again, and a signal that arrives late never blames the next operation.
    Arming and disarming cost a clock read and two attribute writes. Only the main thread can be interrupted;
    elsewhere the watchdog stays off, and :meth:`disarm` still reports an operation that overran.

    Invariant kept: ``slowest`` is the longest an operation took among those that returned within their limit;
    ``seconds`` is the limit of the operations armed now (the run's, except inside :meth:`limited`)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds  # the most one operation may take
        self.slowest = 0.0  # the longest an operation that returned in time took
        self._limit = "--call-timeout"  # what sets ``seconds``, as a hang report names it
        self._deadline: Optional[float] = None  # monotonic time the running operation must finish by
        self._operation: object = ""  # the running operation (a call, or its name), printed only in a report
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._previous_handler: Any = None

    def __enter__(self) -> "Watchdog":
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGUSR1, self._on_signal)
            self._thread = threading.Thread(target=self._watch, name="kvfuzz-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            signal.signal(signal.SIGUSR1, self._previous_handler)
            self._thread = None

    def arm(self, operation: object) -> None:
        self._operation = operation
        self._deadline = time.monotonic() + self.seconds

    def disarm(self) -> bool:
        """The operation ended; returns whether it ended past its deadline (a hang it recovered from by itself, or
        one whose interrupt it swallowed)."""
        deadline, self._deadline = self._deadline, None
        if deadline is None:
            return False
        left = deadline - time.monotonic()
        if left < 0:
            return True
        if self.seconds - left > self.slowest:
            self.slowest = self.seconds - left
        return False

    def hang(self) -> AllocatorHang:
        return AllocatorHang(str(self._operation), self.seconds, self._limit)

    def hang_limit(self) -> float:
        """The limit a hang's shrink confirms a candidate's hang at: :data:`HANG_FACTOR` times the slowest operation
        that returned so far, at least :data:`HANG_FLOOR` seconds, at most the watchdog's own limit. A candidate
        that only runs slow past it is taken for a hang, which the confirming replays, at the full limit, check."""
        return min(self.seconds, max(HANG_FLOOR, HANG_FACTOR * self.slowest))

    @contextlib.contextmanager
    def limited(self, seconds: float, why: str) -> Iterator[None]:
        """While active, operations armed may take at most ``seconds`` (``why`` names that limit in a hang
        report); the watchdog's own limit after."""
        previous = self.seconds, self._limit
        self.seconds, self._limit = seconds, why
        try:
            yield
        finally:
            self.seconds, self._limit = previous

    def _overdue(self) -> bool:
        deadline = self._deadline
        return deadline is not None and time.monotonic() > deadline

    def _watch(self) -> None:
        main = threading.main_thread().ident
        assert main is not None
        while not self._stop.wait(min(0.1, self.seconds / 4)):
            if self._overdue():
                signal.pthread_kill(main, signal.SIGUSR1)

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        if self._overdue():  # the operation running now is late: not a stale signal for an earlier one
            raise self.hang()


JOURNAL_PREFIX = ".kvfuzz-journal-"
JOURNAL_FORMAT = "kvfuzz-journal/1"


def journal_path(directory: Path, pid: Optional[int] = None) -> Path:
    """Where the process ``pid`` (default: this one) keeps its journal in ``directory``."""
    return directory / f"{JOURNAL_PREFIX}{os.getpid() if pid is None else pid}.jsonl"


JOURNAL_LIMIT = 4 * 1024 * 1024
"""Bytes a journal may reach before the next program starts it afresh: only its last program is ever recovered, so
a long run's journal stays this small (plus one program) instead of holding every program it ran."""


def _created(path: Path) -> IO[str]:
    """``path`` as a new, empty file for this process's journal. Whatever held the name (the journal of an earlier
    process with this pid, already recovered, or a link planted in a corpus that came from elsewhere) is removed,
    never written through: the file is created afresh, without following a link."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    return os.fdopen(descriptor, "w", encoding="utf-8")


class Journal:
    """An append-only file of the programs a run executes, one JSON object a line, flushed before each call: a
    header (``{"format": "kvfuzz-journal/1", "pid": ..., **target, **configuration}``), then ``{"example": n}``
    before each program and one line per call, as the target's trace lists it; a program run under another
    configuration than the last header's is preceded by a header of its own. Every target writes this one journal,
    with a payload of its own: the allocator target's header names the allocator (``target``) and its
    ``{"config": ...}`` (``configuration``), its calls ``{"rule": ..., "arguments": {...}}``; a scheduler target's
    header names the scheduler and the engine's version, and ``{"setup": ..., "model_runner": ...}``, its calls
    ``{"op": ...}`` (:func:`kvfuzz.scheduler.trace.journal_configuration`).
    If the process dies, the last program in the file is the one that killed it; :mod:`kvfuzz.saved.journals` turns
    such a journal into a trace of its target. A run that ends normally deletes its journal. A program that starts
    once the file has passed :data:`JOURNAL_LIMIT` bytes starts it afresh, with a header: the programs before it
    are finished. The file is created new, never through a link (:func:`_created`); it is this process's own
    (:func:`journal_path`) unless ``path`` names another (an isolated child writes its parent's, which watches it)."""

    def __init__(
        self,
        directory: Path,
        target: dict[str, Any],
        configuration: dict[str, Any],
        path: Optional[Path] = None,
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = journal_path(directory) if path is None else path
        self._file: Optional[IO[str]] = _created(self.path)
        self._examples = 0
        self._target = target  # what every header names
        self._configuration = configuration  # the configuration the last header records
        self.error: Optional[OSError] = None  # why the journal was given up, if it was
        self._write_header()

    def begin_example(self, configuration: Optional[dict[str, Any]] = None) -> None:
        """A program starts; under ``configuration`` when given (a shrinker replays candidates in smaller pools, a
        scheduler's examples each name theirs): a configuration other than the last header's gets a header of its
        own first, so the program a death leaves last is recovered with the configuration it ran in."""
        if self._file is not None and self._file.tell() > JOURNAL_LIMIT:
            try:
                self._file.seek(0)
                self._file.truncate()
            except OSError as error:
                self.error = error
                self._drop()
            self._write_header()
        if configuration is not None and configuration != self._configuration:
            self._configuration = configuration
            self._write_header()
        self._examples += 1
        self._write({"example": self._examples})

    def _write_header(self) -> None:
        self._write({"format": JOURNAL_FORMAT, "pid": os.getpid(), **self._target, **self._configuration})

    def call(self, record: dict[str, Any]) -> None:
        """One call, about to run, as the target's trace lists it."""
        self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        """Append one line. A journal that cannot be written (a full disk) is given up, never the run: the
        failure it would have kept is still printed and saved by the run itself."""
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as error:
            self.error = error
            self._drop()

    def _drop(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()
        with contextlib.suppress(OSError):
            self.path.unlink()

    def close(self) -> None:
        """The run ended in this process: the journal is not needed."""
        self._drop()
