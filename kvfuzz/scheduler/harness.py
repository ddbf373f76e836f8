"""kvfuzz's own failures told apart from the engine's: an exception raised by kvfuzz's code while it drives the
engine (its worker, its model runner's glue, its session, the checks' own bookkeeping) is a **harness error**, never a
finding. A check's verdict is a :class:`~kvfuzz.scheduler.violations.SchedulerViolation`, and an exception the engine
raises itself has its innermost frame in the engine's code: both are findings. Anything else whose innermost frame is
in the kvfuzz package is kvfuzz failing: a bug of kvfuzz's, or an engine version whose objects kvfuzz reads wrongly
(an attribute renamed, a field removed).

A :class:`HarnessError` is a ``BaseException``, so that Hypothesis neither counts it as a failing example nor shrinks
it, and no ``except Exception`` on the way mistakes it for the engine's: it ends the search, the run, the replay or
the campaign, reported with its traceback and a one-line hint, its own exit status (3), nothing saved, nothing
counted as new or known."""

from __future__ import annotations

import traceback
from pathlib import Path

from kvfuzz.scheduler.violations import SchedulerViolation

KVFUZZ_PACKAGE = Path(__file__).resolve().parent.parent
"""The kvfuzz package's directory: an innermost frame under it is kvfuzz's code."""

HARNESS_STATUS = 3
"""The exit status of a command that met a harness error (as for kvfuzz itself failing elsewhere)."""


class HarnessError(BaseException):
    """kvfuzz's own code raised ``original`` while driving ``engine`` (its name and installed version)."""

    def __init__(self, original: BaseException, engine: str = "the engine") -> None:
        self.original = original  # what kvfuzz's code raised, its traceback kept
        self.engine = engine
        super().__init__(f"{type(original).__name__}: {original}")

    def where(self) -> str:
        """The innermost frame, ``path:line in function``, the path from the package on."""
        frames = traceback.extract_tb(self.original.__traceback__)
        if not frames:
            return "an unknown frame"
        frame = frames[-1]
        path = Path(frame.filename).resolve()
        shown = path.relative_to(KVFUZZ_PACKAGE.parent) if path.is_relative_to(KVFUZZ_PACKAGE.parent) else path
        return f"{shown}:{frame.lineno} in {frame.name}"

    def hint(self) -> str:
        """One line: what it means and what to do."""
        return (
            f"kvfuzz: harness error, not a finding: kvfuzz's own code raised {type(self.original).__name__} at "
            f"{self.where()} while driving {self.engine}; either kvfuzz has a bug or it does not speak this engine "
            "version: nothing was saved; report it to kvfuzz with the traceback above"
        )

    def describe(self) -> str:
        """The traceback of what kvfuzz's code raised, then :meth:`hint`."""
        lines = traceback.format_exception(type(self.original), self.original, self.original.__traceback__)
        return "".join(lines).rstrip() + "\n" + self.hint()


def raised_by_kvfuzz(error: BaseException) -> bool:
    """Whether ``error`` is kvfuzz's own failure: an ``Exception`` that is not a check's verdict, whose innermost
    frame is in the kvfuzz package."""
    if not isinstance(error, Exception) or isinstance(error, SchedulerViolation):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(KVFUZZ_PACKAGE)


def as_harness_error(error: BaseException, engine: str) -> BaseException:
    """``error`` as a :class:`HarnessError` if kvfuzz's code raised it (:func:`raised_by_kvfuzz`), else itself."""
    return HarnessError(error, engine) if raised_by_kvfuzz(error) else error
