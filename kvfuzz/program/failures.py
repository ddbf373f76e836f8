"""What kind of failure a program met: an invariant broken, a crash, or a hang. Two failures of one kind are the same
bug for shrinking and confirmation; a failure signature (:mod:`kvfuzz.shrink.signature`) adds where it happened."""

from __future__ import annotations

from typing import Union

import attrs

from kvfuzz.engine.violations import Invariant
from kvfuzz.program.safeguards import AllocatorHang


@attrs.frozen
class Broken:
    """An invariant (or a declared policy) kvfuzz checks was broken."""

    invariant: Invariant

    def __str__(self) -> str:
        return str(self.invariant)


@attrs.frozen
class Crash:
    """An exception the allocator (or kvfuzz) raised: ``exception`` names its type (for a ``BaseException`` that
    escaped the allocator, the type that escaped)."""

    exception: str

    def __str__(self) -> str:
        return f"crash ({self.exception})"


@attrs.frozen
class Hang:
    """An operation did not return within the watchdog's limit."""

    def __str__(self) -> str:
        return "hang"


FailureKind = Union[Broken, Crash, Hang]
"""One failure record: what is printed (``str``), compared and passed around, never a display string beside it."""


def failure_kind(error: BaseException) -> FailureKind:
    """The kind of failure ``error`` is."""
    invariant = getattr(error, "invariant", None)  # an InvariantViolation's, or a wrapper's that carries one
    if isinstance(invariant, Invariant):
        return Broken(invariant)
    if isinstance(error, AllocatorHang):
        return Hang()
    original = getattr(error, "original", None)
    return Crash(type(original if isinstance(original, BaseException) else error).__name__)
