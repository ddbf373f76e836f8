"""Random programs over the operation table, run without Hypothesis.

Plain random programs (every enabled operation equally likely, arguments drawn as the machine draws them, lengths
uniform up to the step budget) reach many allocator bugs in fewer examples than Hypothesis's generation, which
starts from the simplest programs and switches rules off per example. kvfuzz therefore spends the first examples of
a run on random programs; a failure among them is shrunk by replay (deleting calls) and reported like any other.
With a swarm (:mod:`kvfuzz.program.swarm`), every :data:`SWARM_EVERY`-th program is instead drawn over its own
weighted subset of the operations, longer, and half the time in a smaller pool, as a campaign's are: the whole
table's programs stay the ones a search without a swarm runs (their own random stream, in their order), and the
swarm's reach what a crowd of cheap operations, a roomy pool and a short program hide.
The programs are made of the machine's own rule calls, so they print, save and replay the same way.
"""

from __future__ import annotations

import functools
import random
from typing import Any, Callable, Optional, Sequence

import attrs

from kvfuzz.engine.arguments import snapshot_of
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.operation import Operation, enablement_of
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Execution, Target
from kvfuzz.program.operations import OPERATIONS
from kvfuzz.program.safeguards import AllocatorHang
from kvfuzz.program.swarm import Swarm

SWARM_EVERY = 3
"""With a swarm, every third program (the third, the sixth, ...) is drawn over a swarm's subset; the others over
the whole table."""

SWARM_LENGTH = (2, 6)
"""A swarmed program's length, as multiples of the run's step budget (uniform between them): deep slips need a long
program, as a campaign's run up to 300 calls, where the whole table's programs keep the budget."""


@attrs.frozen
class RandomFailure:
    """The first failing random program: its calls (a hang's up to the call that hung), what it raised (a hang is
    returned like any failure, so that the pool it hung in goes with it), and the pool it ran in (``config``, None:
    the search's own)."""

    calls: tuple[Call, ...]
    failure: Exception | AllocatorHang
    config: Optional[MachineConfig] = None


def random_search(
    target: Target,
    *,
    examples: int,
    steps: int,
    seed: Optional[int],
    operations: Sequence[Operation] = OPERATIONS,
    swarm: Optional[Callable[[random.Random, Sequence[Operation]], Swarm]] = None,
) -> Optional[RandomFailure]:
    """Run up to ``examples`` random programs of up to ``steps`` calls over ``operations`` (a swarmed one longer);
    return the first that fails. With a ``swarm`` (such as :func:`~kvfuzz.program.swarm.draw_swarm`), every
    :data:`SWARM_EVERY`-th program is instead over the weighted subset of ``operations`` it draws for that program,
    in the pool it draws (if any: the failure then says which), and of :data:`SWARM_LENGTH` times ``steps`` calls (a
    deep bug needs a long program as often as a mix of operations), from a random stream of its own, so that the
    others are the programs a search without a swarm runs, in its order. The subsets drawn are counted in the
    target's stats (:attr:`~kvfuzz.program.stats.RunStats.swarms`)."""
    rng = random.Random(seed)
    swarm_rng = random.Random(None if seed is None else f"swarm {seed}")
    for example in range(examples):
        if swarm is None or example % SWARM_EVERY != SWARM_EVERY - 1:
            found = random_program(target, rng, rng.randint(1, steps), operations)
        else:
            drawn = swarm(swarm_rng, operations)
            if target.stats is not None:
                target.stats.swarms.add(drawn.names())
            pooled = target if drawn.config is None else attrs.evolve(target, config=drawn.config)
            found = random_program(
                pooled,
                swarm_rng,
                swarm_rng.randint(steps * SWARM_LENGTH[0], steps * SWARM_LENGTH[1]),
                drawn.operations,
                weights=drawn.weights,
            )
            if found is not None and drawn.config is not None:
                return attrs.evolve(found, config=drawn.config)
        if found is not None:
            return found
    return None


def random_program(
    target: Target,
    rng: random.Random,
    length: int,
    operations: Sequence[Operation] = OPERATIONS,
    weights: Optional[Sequence[float]] = None,
) -> Optional[RandomFailure]:
    """Run one random program of ``length`` calls, each an operation of ``operations`` enabled at that point (the
    caller keeps one that is always enabled, such as ``admit``), then the teardown; the failure, if it fails. The
    enabled operations are equally likely, or with ``weights`` (one per operation, positive) chosen in proportion
    to theirs. A call that hangs past the watchdog's limit ends the program like any failure."""

    def calls(execution: Execution) -> None:
        draws = CallDraws(execution, operations, weights)
        for _ in range(length):
            drawn = draws.draw(rng)
            if drawn is None:
                break
            execution.execute(*drawn)

    return run_program(target, calls)


def run_program(target: Target, calls: Callable[[Execution], None]) -> Optional[RandomFailure]:
    """Make a program's ``calls`` on a fresh allocator, then the teardown; the failure, if it fails (a hang past the
    watchdog's limit included, its calls up to the one that hung)."""
    try:
        execution = target.start()
    except Exception as error:  # noqa: BLE001 -- the factory failed to build this program's allocator
        return RandomFailure((), error)
    try:
        calls(execution)
        execution.teardown()
    except (Exception, AllocatorHang) as error:  # noqa: BLE001 -- any failure is the finding, as for the machine
        return RandomFailure(tuple(execution.calls), error)
    finally:
        execution.engine.close()
    return None


class CallDraws:
    """Draws one call at a time for a running program: an operation of ``operations`` (those the allocator's
    capabilities declare) enabled in the state the calls before it left, with arguments drawn as the machine draws
    them. The enabled operations are equally likely, or with ``weights`` (one per operation, positive) chosen in
    proportion to theirs."""

    def __init__(
        self, execution: Execution, operations: Sequence[Operation], weights: Optional[Sequence[float]] = None
    ) -> None:
        self.snapshot = snapshot_of(execution.engine.expected)  # the state's queries, answered once per state
        caps = execution.engine.expected.caps
        weighted = zip(operations, weights) if weights is not None else ((operation, 1.0) for operation in operations)
        declared = [(operation, weight) for operation, weight in weighted if operation.declared(caps)]
        self.enablement = enablement_of(tuple(declared))  # also the key its answer is kept under while the state stays
        self.weighted = weights is not None

    def draw(self, rng: random.Random, named: Optional[str] = None) -> Optional[tuple[str, dict[str, Any]]]:
        """A call (operation name, arguments) for the state now, or None when no operation is enabled. With
        ``named``, that operation when it is enabled (its arguments drawn afresh), else any enabled one."""
        state = self.snapshot.renewed()  # the state after the previous call (the same answers if it changed nothing)
        enabled = state.kept(self.enablement, functools.partial(self.enablement.enabled, state))
        if not enabled:
            return None
        chosen = next((operation for operation, _ in enabled if operation.name == named), None) if named else None
        if chosen is not None:
            operation = chosen
        elif not self.weighted:  # rng.choice: the stream seeded programs without weights always drew
            operation = rng.choice(enabled)[0]
        else:
            operation = rng.choices(enabled, [weight for _, weight in enabled])[0][0]
        return operation.name, operation.draw(state, rng)
