"""A scheduler step bounded by the watchdog: a step that runs past ``--call-timeout`` is interrupted (the
watchdog's :class:`~kvfuzz.program.safeguards.AllocatorHang`) and becomes a :attr:`Check.HANG` violation naming the
frame the interrupt found it in, and a step that returned only after its deadline (it swallowed the interrupt, or
recovered by itself) is one too. Both scheduler targets bound their steps with it (vLLM's ``Session``, SGLang's
``SGLangSession``); a hang is a finding with the program that got there, never a stuck search."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Callable, Optional, TypeVar

from kvfuzz.program.safeguards import AllocatorHang, Watchdog
from kvfuzz.scheduler.violations import Check, SchedulerViolation

T = TypeVar("T")

HANG_CAUSE = "a step that does not return"
"""The hang check's cause, whichever target's step hung (one finding per hang, not per frame)."""


def interrupted_in(hang: BaseException) -> str:
    """Where the watchdog's interrupt found the step: the innermost frame outside the watchdog, as
    ``module.function``."""
    frames = traceback.extract_tb(hang.__traceback__)[:-1]  # the last is the watchdog's own signal handler
    if not frames:
        return "an unknown frame"
    frame = frames[-1]
    return f"{Path(frame.filename).stem}.{frame.name} ({frame.filename}:{frame.lineno})"


def bounded_step(watchdog: Optional[Watchdog], step: int, parts: str, action: Callable[[], T]) -> T:
    """``action()``, the engine's step number ``step`` (whose ``parts`` a report names), bounded by ``watchdog``
    (entered by the caller; None: unbounded). Raises the hang check's :class:`SchedulerViolation` when the step
    is interrupted or returns past its deadline."""
    if watchdog is None:
        return action()
    watchdog.arm(f"step {step}")
    try:
        result = action()
    except AllocatorHang as hang:
        watchdog.disarm()
        raise SchedulerViolation(
            Check.HANG,
            step,
            None,
            f"step {step} ({parts}) did not return within {hang.seconds:g} s (--call-timeout); interrupted in "
            f"{interrupted_in(hang)}",
            HANG_CAUSE,
        ) from None
    if watchdog.disarm():
        raise SchedulerViolation(
            Check.HANG,
            step,
            None,
            f"step {step} returned only after more than {watchdog.seconds:g} s (--call-timeout)",
            HANG_CAUSE,
        )
    return result
