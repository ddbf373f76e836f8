"""Random programs over the operation table, run without Hypothesis.

Plain random programs (each over the operations given, or over its own subset of them that a swarm draws,
:mod:`kvfuzz.program.swarm`; every enabled operation of the program's set equally likely, arguments drawn as the
machine draws them, lengths uniform up to the step budget) reach many allocator bugs in fewer examples than
Hypothesis's generation, which starts from the simplest programs and switches rules off per example. kvfuzz
therefore spends the first examples of a run on random programs; a failure among them is shrunk by replay
(deleting calls) and reported like any other.
The programs are made of the machine's own rule calls, so they print, save and replay the same way.
"""

from __future__ import annotations

import random
from typing import Callable, Optional, Sequence

import attrs

from kvfuzz.engine.arguments import Snapshot
from kvfuzz.engine.operation import Operation
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Target
from kvfuzz.program.operations import OPERATIONS


@attrs.frozen
class RandomFailure:
    """The first failing random program: its calls and what it raised."""

    calls: tuple[Call, ...]
    failure: Exception


def random_search(
    target: Target,
    *,
    examples: int,
    steps: int,
    seed: Optional[int],
    operations: Sequence[Operation] = OPERATIONS,
    swarm: Optional[Callable[[random.Random, Sequence[Operation]], Sequence[Operation]]] = None,
) -> Optional[RandomFailure]:
    """Run up to ``examples`` random programs of up to ``steps`` calls over ``operations``, or with a ``swarm``
    (such as :func:`~kvfuzz.program.swarm.draw_operations`) each over the subset of ``operations`` it draws for
    that program; return the first that fails. The subsets drawn are counted in the target's stats
    (:attr:`~kvfuzz.program.stats.RunStats.swarms`)."""
    rng = random.Random(seed)
    for _ in range(examples):
        chosen = operations if swarm is None else swarm(rng, operations)
        if target.stats is not None:
            target.stats.swarms.add(tuple(operation.name for operation in chosen))
        found = random_program(target, rng, rng.randint(1, steps), chosen)
        if found is not None:
            return found
    return None


def random_program(
    target: Target, rng: random.Random, length: int, operations: Sequence[Operation] = OPERATIONS
) -> Optional[RandomFailure]:
    """Run one random program of ``length`` calls, each an operation of ``operations`` enabled at that point (the
    caller keeps one that is always enabled, such as ``admit``), then the teardown; the failure, if it fails."""
    try:
        execution = target.start()
    except Exception as error:  # noqa: BLE001 -- the factory failed to build this program's allocator
        return RandomFailure((), error)
    try:
        snapshot = Snapshot(execution.engine.expected)
        declared = [operation for operation in operations if operation.declared(execution.engine.expected.caps)]
        for _ in range(length):
            state = snapshot.renewed()  # the state after the previous call
            enabled = [operation for operation in declared if operation.allowed(state)]
            if not enabled:
                break
            operation = rng.choice(enabled)
            execution.execute(operation.name, operation.draw(state, rng))
        execution.teardown()
    except Exception as error:  # noqa: BLE001 -- any failure is the finding, as for the machine
        return RandomFailure(tuple(execution.calls), error)
    finally:
        execution.engine.close()
    return None
