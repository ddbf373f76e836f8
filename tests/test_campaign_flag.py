"""The campaign's stop and halt flags survive a process killed while it waits on them: setting one afterwards
returns at once. Before, they were multiprocessing Events, and ``set()`` after a waiter was killed in ``wait()``
blocked forever (a campaign ending on a harness error in a worker hung for the test's whole timeout)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

from kvfuzz.campaign.flag import Flag


def _set_returns_after_a_waiter_is_killed(flag) -> bool:  # type: ignore[no-untyped-def]
    context = multiprocessing.get_context("fork")
    waiter = context.Process(target=flag.wait)
    waiter.start()
    time.sleep(0.5)  # in wait()
    assert waiter.pid is not None
    os.kill(waiter.pid, signal.SIGKILL)
    waiter.join()
    setter = threading.Thread(target=flag.set, daemon=True)
    setter.start()
    setter.join(5)
    return not setter.is_alive()


def test_setting_the_flag_after_a_waiter_was_killed_returns() -> None:
    flag = Flag(multiprocessing.get_context("fork"))
    assert _set_returns_after_a_waiter_is_killed(flag)
    assert flag.is_set()


def test_a_multiprocessing_event_in_its_place_would_hang() -> None:
    """The failure the flag replaces, shown on the Event itself (so this test fails if the platform's Event stops
    having it, and the flag's reason to exist should be reread)."""
    assert not _set_returns_after_a_waiter_is_killed(multiprocessing.get_context("fork").Event())


def test_wait_returns_once_another_process_sets_the_flag() -> None:
    context = multiprocessing.get_context("fork")
    flag = Flag(context)
    setter = context.Process(target=flag.set)
    setter.start()
    setter.join()
    started = time.monotonic()
    flag.wait()
    assert time.monotonic() - started < 5
