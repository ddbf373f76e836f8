"""Typed errors of the allocator contract.

Every refusal an allocator makes is one of these. A refusal is atomic: whatever the allocator raises, its observable
state (block tables, refcounts, free and cached sets) is exactly what it was before the call.
"""

from __future__ import annotations


class AllocatorError(Exception):
    """Base of every error the contract defines."""


class OutOfBlocks(AllocatorError):
    """The pool cannot hold what was asked for, even after evicting every evictable cached block.

    ``needed`` is the number of fresh blocks the operation required and ``available`` the number the allocator could
    have handed out (free plus evictable), when it knows them; either may be ``None``.
    """

    def __init__(self, message: str, *, needed: int | None = None, available: int | None = None) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


class Misuse(AllocatorError):
    """The caller broke the contract (unknown sequence, double free, ...). Nothing was changed."""


class UnknownSequence(Misuse):
    """The operation names a sequence the allocator does not hold (never admitted, freed, or preempted)."""


class SequenceExists(Misuse):
    """The operation would create a sequence under an id that is already live."""


class InvalidArgument(Misuse):
    """An argument is out of range: no tokens, rollback past the start, a negative count, a bad state for the op."""


class Unsupported(Misuse):
    """The allocator does not declare the capability this operation needs."""
