"""Swarm testing over the operation table: each program calls only a random subset of the operations.

With every operation equally likely in every program, the cheap operations a growing table adds crowd out the ones
deep bugs need (a run spent more than a thousand calls on targeted eviction while its cache hits halved). Leaving a
random half of the operations out of each program makes the remaining ones several times as frequent there, and
leaving one out is sometimes what a bug needs (a rollback slip shows when swap never takes the blocks first). Both
``kvfuzz run``'s random programs and a campaign's swarms draw their subsets here; a subset always keeps
:data:`ALWAYS_ENABLED`, so a program never runs out of calls, and one draw in :data:`EVERYTHING` keeps every
operation, so an operation a bug needs together with all the others is never out of reach.

The subset is a property of how a program was drawn, not of the program: a printed, saved or replayed program is
its calls, and replaying them does not ask which operations were drawn.
"""

from __future__ import annotations

import random
from typing import Sequence

from kvfuzz.engine.operation import Operation
from kvfuzz.program.operations import OPERATIONS

ALWAYS_ENABLED = ("admit", "step")
"""Operations every swarm keeps: admit is always enabled (so a program never runs out of calls), step makes the
written K/V real."""

EVERYTHING = 0.25
"""The share of draws that keep every operation."""

KEEP = 0.5
"""The chance that any other operation is kept in a draw that does not keep everything."""


def draw_operations(rng: random.Random, operations: Sequence[Operation] = OPERATIONS) -> tuple[Operation, ...]:
    """A subset of ``operations`` in their order: those of :data:`ALWAYS_ENABLED`, and each other one with
    probability :data:`KEEP`, or every one with probability :data:`EVERYTHING`."""
    everything = rng.random() < EVERYTHING
    return tuple(
        operation for operation in operations if operation.name in ALWAYS_ENABLED or everything or rng.random() < KEEP
    )
