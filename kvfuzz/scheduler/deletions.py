"""A scheduler program as the shared deletion pass sees it (:class:`kvfuzz.shrink.deletion.Deletable`): what
deleting operations takes with it, and what its operations name.

A request's id is its place among the program's additions (``r0``, ``r1``, ... in order), so deleting an addition
renames every later request: the operations that name a request (an abort, a resume) are renamed with it, and those
naming a request deleted go too. A candidate is judged by ``fails``, the caller's (its replay, under the failure's
signature).

Invariant: every program this module returns names only requests it adds before naming them, if the program given
did."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import attrs

from kvfuzz.scheduler.program import Abort, AddRequest, Operation, Resume


class SchedulerDeletions:
    """A scheduler program's deletions, for :func:`~kvfuzz.shrink.deletion.delete_operations`."""

    def __init__(self, fails: Callable[[list[Operation]], bool]) -> None:
        self._fails = fails  # whether a candidate fails with the shrink's signature

    def fails(self, candidate: list[Operation]) -> Optional[list[Operation]]:
        return candidate if self._fails(candidate) else None

    def without(self, program: list[Operation], start: int, end: int) -> list[Operation]:
        return dropping(program, set(range(start, end)))

    def names(self, program: Sequence[Operation]) -> list[str]:
        """Every request the program adds, the last first: deleting one renames only those after it, so the names
        still to try keep theirs."""
        added = sum(isinstance(operation, AddRequest) for operation in program)
        return [f"r{index}" for index in reversed(range(added))]

    def without_name(self, program: list[Operation], name: str) -> list[Operation]:
        additions = [position for position, operation in enumerate(program) if isinstance(operation, AddRequest)]
        index = int(name[1:])
        return dropping(program, {additions[index]}) if index < len(additions) else list(program)


def dropping(program: Sequence[Operation], positions: set[int]) -> list[Operation]:
    """``program`` less the operations at ``positions`` and every operation naming a request one of them added, the
    requests after renamed to their new places."""
    kept: list[Operation] = []
    renamed: dict[str, str] = {}  # a request kept: its id in the program given -> its id in the one returned
    added = 0
    for position, operation in enumerate(program):
        if isinstance(operation, AddRequest):
            if position not in positions:
                renamed[f"r{added}"] = f"r{len(renamed)}"
                kept.append(operation)
            added += 1
        elif position in positions:
            continue
        elif isinstance(operation, (Abort, Resume)):
            if operation.request in renamed:
                kept.append(attrs.evolve(operation, request=renamed[operation.request]))
        else:
            kept.append(operation)
    return kept
