"""One worker process of a campaign, whatever its target: how it starts and ends (:func:`worker_main`), how long the
campaign waits for a word from it (:func:`patience_of`), and how a stop reaches a shrink it does not drive
(:class:`HaltInterrupts`).

The signals that stop a campaign (Ctrl-C, SIGTERM, SIGHUP: a terminal or ``timeout`` sends them to the whole process
group) are the supervisor's to handle: it sets ``stop`` (search no more) and, on a signal, ``halt`` (a shrink in
progress ends too), which a target's shrink asks itself, or (:class:`HaltInterrupts`) is turned into a
:class:`~kvfuzz.program.safeguards.UserInterrupt` raised in the worker's main thread wherever it runs (SIGUSR2: the
watchdog has SIGUSR1), so that a shrink inside a search the worker does not drive (Hypothesis's) stops as promptly.
A worker whose campaign is gone, however it died, winds down the same way and is ended if that takes longer than
the campaign's patience (:mod:`kvfuzz.lifeline`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import traceback
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from types import FrameType
from typing import Any, Iterator, Optional

from kvfuzz.campaign.flag import Flag
from kvfuzz.campaign.known import KnownFindings
from kvfuzz.campaign.messages import Crashed, Done
from kvfuzz.campaign.protocol import CampaignTarget, Channel, Reporter, WorkerContext
from kvfuzz.lifeline import tie_to_parent
from kvfuzz.program.safeguards import DEFAULT_CALL_TIMEOUT, STOP_SIGNALS, UserInterrupt, journal_path
from kvfuzz.threads import single_threaded_torch


def patience_of(call_timeout: Optional[float]) -> float:
    """Seconds without a word from a worker before the campaign takes it for hung in C code the watchdog cannot
    interrupt; also how long a worker whose campaign died has to save what it holds."""
    return 2 * (call_timeout or DEFAULT_CALL_TIMEOUT) + 10.0


def worker_main(
    target: CampaignTarget,
    slot: int,
    incarnation: int,
    seed: int,
    known: KnownFindings,
    queue: Channel,
    stop: Flag,
    halt: Flag,
    budget: "Synchronized[int]",
    state: Path,
    claims: Path,
    supervisor: int,
    ends: Optional[float],
) -> None:
    """The worker process: ``target.search`` until ``stop`` is set or the budget runs out; kvfuzz's own errors are
    sent as :class:`Crashed` (see the module for the signals)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    reporter = Reporter(queue, slot)

    def orphaned() -> None:
        halt.set()
        stop.set()

    patience = patience_of(target.settings.call_timeout)
    journal = journal_path(target.settings.corpus)
    tie_to_parent(supervisor, orphaned, patience, lambda: journal.unlink(missing_ok=True), patience + 10)
    context = WorkerContext(
        slot, incarnation, seed, reporter, stop, halt, budget, known, state, claims, supervisor, ends
    )
    try:
        with single_threaded_torch():
            target.search(context)
    except UserInterrupt:
        pass  # halted (HaltInterrupts): what the worker held is reported and saved already
    except BaseException:  # noqa: BLE001 -- a bug of kvfuzz's, reported to the campaign instead of lost
        reporter.send(Crashed(slot, traceback.format_exc()))
        return
    reporter.send(Done(slot))


class HaltInterrupts:
    """While :meth:`armed`, ``halt`` raises :class:`UserInterrupt` in this process's main thread wherever it runs
    (see the module): for a target whose shrink kvfuzz does not drive itself (Hypothesis's) and whose failures are on
    disk before they are shrunk (a scheduler's); the allocator's shrink asks ``halt`` itself and saves its program as
    far as it got. Outside :meth:`armed` nothing is raised (a message half sent, a trace half replaced, would be
    lost): the worker's loop sees ``stop``, which is set with ``halt``. A process forked while armed (an isolated
    batch's child) watches for itself when it arms."""

    def __init__(self, halt: Flag) -> None:
        self.halt = halt
        self.watching: Optional[int] = None  # the pid whose thread watches ``halt``
        self.active = False
        self.raising: type[BaseException] = UserInterrupt  # what the armed code is interrupted with

    @contextlib.contextmanager
    def armed(self, raising: type[BaseException] = UserInterrupt) -> Iterator[None]:
        """Interrupt the code run inside with ``raising`` once ``halt`` is set (at once if it is)."""
        if self.watching != os.getpid():
            self._watch()
        self.raising = raising
        self.active = True
        try:
            if self.halt.is_set():
                raise raising()
            yield
        finally:
            self.active = False

    def _watch(self) -> None:
        self.watching = os.getpid()

        def interrupted(signum: int, frame: Optional[FrameType]) -> Any:
            if self.active:
                self.active = False  # once: the interrupted code reports what it holds and the worker ends
                raise self.raising()

        signal.signal(signal.SIGUSR2, interrupted)
        main = threading.main_thread().ident
        assert main is not None

        def watch() -> None:
            self.halt.wait()
            signal.pthread_kill(main, signal.SIGUSR2)

        threading.Thread(target=watch, name="kvfuzz-halt", daemon=True).start()
