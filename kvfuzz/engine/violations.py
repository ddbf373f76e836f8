"""The invariants kvfuzz checks, and the error that reports one broken, written for a person to read."""

from __future__ import annotations

import enum
from typing import Sequence

import attrs


class Invariant(enum.Enum):
    """The invariants of docs/invariants.md, numbered as there; from 13 on, the policies an allocator may declare."""

    CONTENT = (1, "content")
    ATTENTION = (2, "attention")
    REFCOUNTS = (3, "refcounts")
    FREE_SET = (4, "free set")
    EXCLUSIVE_WRITES = (5, "exclusive writes")
    NON_REUSE_WINDOW = (6, "non-reuse window")
    ATOMIC_REFUSAL = (7, "atomic refusal")
    NO_FALSE_REFUSAL = (8, "no false refusal")
    CACHE_SOUNDNESS = (9, "cache soundness")
    QUIESCENCE = (10, "quiescence")
    MISUSE = (11, "misuse")
    RESULTS = (12, "well-formed results")
    EVICTION_ORDER = (13, "eviction order")
    COMPLETE_CACHING = (14, "complete caching")

    @property
    def number(self) -> int:
        return self.value[0]

    @property
    def title(self) -> str:
        return self.value[1]

    def __str__(self) -> str:
        return f"invariant {self.number} ({self.title})"


@attrs.frozen
class Cause:
    """What a check knows about why its invariant broke, in words a person reads (``"a cache hit on K/V another
    prefix wrote"``): with the invariant, it makes a failure one finding (:mod:`kvfuzz.shrink.signature`), so two
    bugs that break one invariant in one operation for different reasons are two findings, and one bug met through
    several operations is one. ``by_operation``: the failing operation is part of the cause (a valid call of the
    operation refused with an unexpected error), so the same words in two operations are two findings.

    The words are the finding's identity: two checks that name the same cause use the same words, and a check names
    nothing in them that varies from one program to the next (no block, sequence or position)."""

    words: str
    by_operation: bool = False

    def refined(self, detail: str) -> Cause:
        """This cause told apart further by ``detail`` (the path that released a block): its words, then ``; `` and
        the detail, so that a trace that recorded the coarser words still reproduces the finer cause
        (:func:`kvfuzz.saved.corpus.reproduces_recorded`)."""
        return Cause(f"{self.words}{REFINED}{detail}", self.by_operation)

    def __str__(self) -> str:
        return self.words


REFINED = "; "
"""What joins a cause's words to the detail that refines them (:meth:`Cause.refined`)."""

UNNAMED = Cause("", by_operation=True)
"""The cause of a violation whose check names none: the failure is then told apart by its operation, as before
checks named causes."""


class InvariantViolation(AssertionError):
    """One invariant broken by one operation: what was expected, what was found, where it came from, and what the
    check knows of its cause."""

    def __init__(
        self,
        invariant: Invariant,
        operation: str,
        step: int,
        summary: str,
        details: Sequence[str] = (),
        cause: Cause = UNNAMED,
    ) -> None:
        self.invariant = invariant
        self.operation = operation
        self.step = step
        self.summary = summary
        self.details = tuple(details)
        self.cause = cause
        super().__init__(self.explain())

    def explain(self) -> str:
        lines = [f"{self.invariant} violated by {self.operation} (scheduling step {self.step}):", f"  {self.summary}"]
        lines.extend(f"  {line}" for line in self.details)
        if self.cause.words:
            lines.append(f"  cause: {self.cause}")
        return "\n".join(lines)


def _violation_type(invariant: Invariant) -> type[InvariantViolation]:
    name = "".join(word.capitalize() for word in invariant.name.split("_")) + "Violation"
    return type(name, (InvariantViolation,), {"__doc__": f"{invariant} broken.", "__module__": __name__})


VIOLATION_TYPES: dict[Invariant, type[InvariantViolation]] = {inv: _violation_type(inv) for inv in Invariant}
"""One exception type per invariant, so that Hypothesis shrinks each kind of failure as a distinct bug instead of
trading one invariant's failure for another's while shrinking."""


def violation(
    invariant: Invariant, operation: str, step: int, summary: str, details: Sequence[str] = (), cause: Cause = UNNAMED
) -> InvariantViolation:
    return VIOLATION_TYPES[invariant](invariant, operation, step, summary, details, cause)
