"""A child process that never outlives its parent, however the parent dies (SIGKILL included).

:func:`tie_to_parent` starts a daemon thread in the child that polls ``os.getppid()``: when the parent dies, the
kernel hands the child to another parent at once, so the pid changes. The child is then asked to wind down (stop
searching, save what it holds), given ``grace`` seconds, and ended: ``cleanup`` runs first (it removes what must not
outlive the child, such as a journal that would otherwise be taken for the allocator killing the process), then
``os._exit``. Two timers of the kernel cover a child whose Python code cannot run at all (C code spinning while it
holds the interpreter lock). The exit is the C library's ``_exit`` itself (``posix._exit``), never ``os._exit``,
which a run replaces while it searches (:func:`kvfuzz.program.safeguards.exits_as_crashes`):

* while the parent lives, the thread keeps re-arming a timer of the process's CPU time (``ITIMER_VIRTUAL``,
  ``deadman`` seconds): only a child that spins that long without the thread getting the interpreter lock once is
  killed by it (SIGVTALRM), and a child stopped with its terminal (Ctrl-Z) uses no CPU time, so it never fires then;
* once orphaned, an alarm (SIGALRM) ends the child ``HARD_STOP`` seconds after the grace, whatever it is doing.

Both signals' default action ends the process; nothing in kvfuzz handles them.
"""

from __future__ import annotations

import os
import posix
import signal
import threading
import time
from typing import Callable, Optional

POLL = 0.1
"""Seconds between two looks at the parent's pid."""

HARD_STOP = 10
"""Seconds after the grace at which an orphan is ended by the kernel's alarm, if its own thread could not end it."""

ORPHAN_EXIT = 75
"""The exit status of a child ended by :func:`tie_to_parent` (``EX_TEMPFAIL``): its parent is gone."""


def tie_to_parent(
    parent: int,
    wind_down: Callable[[], None],
    grace: float,
    cleanup: Callable[[], None] = lambda: None,
    deadman: Optional[float] = None,
) -> threading.Thread:
    """Watch ``parent`` (the pid the child was started by) from a daemon thread; see the module. ``wind_down`` runs
    once, in that thread, as soon as the parent is gone; ``cleanup`` and the exit follow ``grace`` seconds later
    unless the process has exited by then. ``deadman`` (CPU seconds) arms the timer for a child stuck in C code;
    None leaves it off. Returns the thread."""

    def watch() -> None:
        while os.getppid() == parent:
            if deadman is not None:
                signal.setitimer(signal.ITIMER_VIRTUAL, deadman)
            time.sleep(POLL)
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.alarm(int(grace) + HARD_STOP)
        try:
            wind_down()
            time.sleep(grace)
        finally:
            cleanup()
            posix._exit(ORPHAN_EXIT)

    thread = threading.Thread(target=watch, name="kvfuzz-lifeline", daemon=True)
    thread.start()
    return thread
