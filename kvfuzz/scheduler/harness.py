"""kvfuzz's own failures told apart from the engine's: an exception raised by kvfuzz's code while it drives the
engine (its worker, its model runner's glue, its session, the checks' own bookkeeping) is a **harness error**, never a
finding. A check's verdict is a :class:`~kvfuzz.scheduler.violations.SchedulerViolation`, and an exception the engine
raises itself has its innermost frame in the engine's code: both are findings. Anything else whose innermost frame is
in the kvfuzz package is kvfuzz failing: a bug of kvfuzz's, or an engine version whose objects kvfuzz reads wrongly
(an attribute renamed, a field removed). The standard library's frames are looked through: ``dataclasses.replace``
refusing a field kvfuzz names fails in kvfuzz's call, not in the standard library.

A :class:`HarnessError` is a ``BaseException``, so that Hypothesis neither counts it as a failing example nor shrinks
it, and no ``except Exception`` on the way mistakes it for the engine's: it ends the search, the run, the replay or
the campaign, reported with its traceback and a one-line hint, its own exit status (3), nothing saved, nothing
counted as new or known."""

from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path
from typing import Callable, Optional

from kvfuzz.scheduler.violations import SchedulerViolation

KVFUZZ_PACKAGE = Path(__file__).resolve().parent.parent
"""The kvfuzz package's directory: an innermost frame under it is kvfuzz's code."""

_STANDARD_LIBRARY = tuple({Path(sysconfig.get_paths()[name]).resolve() for name in ("stdlib", "platstdlib")})
_INSTALLED = tuple({Path(sysconfig.get_paths()[name]).resolve() for name in ("purelib", "platlib")})
"""Where installed packages live: inside ``platstdlib`` in a virtual environment, yet never the standard library."""

HARNESS_STATUS = 3
"""The exit status of a command that met a harness error (as for kvfuzz itself failing elsewhere)."""


class HarnessError(BaseException):
    """kvfuzz's own code failed while driving the engine: ``traceback`` is what it raised, as Python prints it, and
    ``hint`` the one line that says what that means. It carries text alone, so that an isolated batch's child can
    send it back to the campaign (pickled) and the campaign report it as the child's."""

    def __init__(self, traceback_text: str, hint: str) -> None:
        self.traceback_text = traceback_text
        self.hint = hint
        super().__init__(traceback_text, hint)

    @classmethod
    def of(cls, original: BaseException, engine: str) -> HarnessError:
        """The harness error of ``original``, which kvfuzz's code raised while driving ``engine`` (its name and
        installed version)."""
        frame = _innermost(original)
        where = "an unknown frame"
        if frame is not None:
            path = Path(frame.filename).resolve()
            shown = path.relative_to(KVFUZZ_PACKAGE.parent) if path.is_relative_to(KVFUZZ_PACKAGE.parent) else path
            where = f"{shown}:{frame.lineno} in {frame.name}"
        hint = (
            f"kvfuzz: harness error, not a finding: kvfuzz's own code raised {type(original).__name__} at {where} "
            f"while driving {engine}; either kvfuzz has a bug or it does not speak this engine version: nothing was "
            "saved; report it to kvfuzz with the traceback above"
        )
        text = "".join(traceback.format_exception(type(original), original, original.__traceback__)).rstrip()
        return cls(text, hint)

    def describe(self) -> str:
        """The traceback of what kvfuzz's code raised, then the hint."""
        return f"{self.traceback_text}\n{self.hint}"


def _innermost(error: BaseException) -> Optional[traceback.FrameSummary]:
    """The innermost frame of ``error``'s traceback outside the standard library (the innermost of all when every
    frame is in it)."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        path = Path(frame.filename).resolve()
        standard = any(path.is_relative_to(place) for place in _STANDARD_LIBRARY)
        if standard and not any(path.is_relative_to(place) for place in _INSTALLED):
            continue
        return frame
    return frames[-1] if frames else None


def raised_by_kvfuzz(error: BaseException) -> bool:
    """Whether ``error`` is kvfuzz's own failure: an ``Exception`` that is not a check's verdict, whose innermost
    frame outside the standard library is in the kvfuzz package."""
    if not isinstance(error, Exception) or isinstance(error, SchedulerViolation):
        return False
    frame = _innermost(error)
    if frame is None or frame.filename.startswith("<"):  # code compiled from a string (<stdin>, <string>): not ours
        return False
    return Path(frame.filename).resolve().is_relative_to(KVFUZZ_PACKAGE)


def raise_if_kvfuzz_s(error: BaseException, engine: Callable[[], str]) -> None:
    """Raise ``error``'s :class:`HarnessError` if kvfuzz's code raised it (:func:`raised_by_kvfuzz`), while driving
    the engine ``engine()`` names (asked only then: reading an engine's version costs); return otherwise (the caller
    handles the engine's exception or the check's verdict as before)."""
    if raised_by_kvfuzz(error):
        raise HarnessError.of(error, engine()) from None
