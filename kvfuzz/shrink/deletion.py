"""Delta debugging over a failing program, for every target: operations deleted in chunks of halving size down to
single ones, then every window of two or three neighbours, then every operation naming one thing (a sequence, a
request) at once; a candidate kept only when the target says it still fails the same way.

A target says, through :class:`Deletable`, what its programs are made of: how a candidate is judged (its replay,
under the failure's signature), what deleting a slice takes with it (the later operations of what the slice brought
in: a sequence it admitted, a request it added), and which names its operations carry. Its operations are opaque
here; the pass never builds one.

Invariant: every program returned is one ``fails`` kept (or the program given, when none was), and never longer than
the program given.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence, TypeVar

Op = TypeVar("Op")


class Deletable(Protocol[Op]):
    """What a target tells the deletion pass about its programs."""

    def fails(self, candidate: list[Op]) -> Optional[list[Op]]:
        """The candidate as its replay ran it, if it fails with the shrink's signature (None: it passes, fails
        otherwise, or cannot run)."""
        ...

    def without(self, program: list[Op], start: int, end: int) -> list[Op]:
        """``program`` less its operations from ``start`` to ``end`` and every later one that needs them."""
        ...

    def names(self, program: Sequence[Op]) -> list[str]:
        """What ``program``'s operations name (sequences, requests), in the order their operations are deleted
        together."""
        ...

    def without_name(self, program: list[Op], name: str) -> list[Op]:
        """``program`` less every operation naming ``name``."""
        ...


def delete_operations(program: Sequence[Op], target: Deletable[Op], out_of_time: Callable[[], bool]) -> list[Op]:
    """Delta debugging: chunks of halving size (each with what the target says goes with it), then every window of
    two or three neighbouring operations (a preempt and its readmit go together), then every name's operations at
    once (an admission and everything naming it). Each costs a number of replays about linear in the program's
    length; stops early when ``out_of_time``."""
    current = list(program)
    chunk = max(1, len(current) // 2)
    while chunk >= 1 and not out_of_time():
        start, deleted = 0, False
        while start < len(current) and not out_of_time():
            candidate = target.without(current, start, start + chunk)
            found = target.fails(candidate) if candidate else None
            if found is not None:
                current, deleted = found, True
            else:
                start += chunk
        if not deleted:
            chunk //= 2
    for width in (2, 3):
        start = 0
        while start + width <= len(current) and not out_of_time():
            candidate = current[:start] + current[start + width :]
            found = target.fails(candidate) if candidate else None
            if found is not None:
                current = found
            else:
                start += 1
    for name in target.names(current):
        if out_of_time():
            break
        candidate = target.without_name(current, name)
        shorter = candidate and len(candidate) < len(current)
        found = target.fails(candidate) if shorter else None
        if found is not None:
            current = found
    return current
