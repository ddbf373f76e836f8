"""A flag a campaign's processes share: set once by any of them, read by polling.

It holds no lock: a process killed while it reads or waits on it leaves it usable. (A ``multiprocessing`` Event
whose waiter is killed in ``wait()`` leaves a sleeper counted that never wakes, and the next ``set()`` blocks
forever waiting for it: a campaign ending on a harness error hung that way.)"""

from __future__ import annotations

import time
from multiprocessing.context import BaseContext
from typing import Any

POLL_SECONDS = 0.05  # how often :meth:`Flag.wait` looks


class Flag:
    """A boolean in shared memory, False until :meth:`set`; it never goes back."""

    def __init__(self, context: BaseContext) -> None:
        self._value: Any = context.RawValue("b", 0)  # 0 until set, then 1: one byte, written and read whole

    def set(self) -> None:
        self._value.value = 1

    def is_set(self) -> bool:
        return bool(self._value.value)

    def wait(self) -> None:
        """Return once the flag is set (by any process)."""
        while not self._value.value:
            time.sleep(POLL_SECONDS)
