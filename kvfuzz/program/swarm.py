"""Swarm testing over the operation table: each program calls only a random subset of the operations, each as often
as the weight the swarm drew for it.

With every operation equally likely in every program, the cheap operations a growing table adds crowd out the ones
deep bugs need (a run spent more than a thousand calls on targeted eviction while its cache hits halved). Leaving a
random half of the operations out of each program makes the remaining ones several times as frequent there, and
leaving one out is sometimes what a bug needs (a rollback slip shows when swap never takes the blocks first). Both
``kvfuzz run``'s random programs and a campaign's swarms draw their subsets here; a subset always keeps
:data:`ALWAYS_ENABLED`, so a program never runs out of calls, and one draw in :data:`EVERYTHING` keeps every
operation, so an operation a bug needs together with all the others is never out of reach.

``kvfuzz run``'s swarms (:func:`draw_swarm`) also weigh the operations they keep: each its :data:`WEIGHTS` (the
calls that build state, admit, grow and decode, above those that only tear it down or probe it) times a factor drawn
per swarm, so that one swarm leans on swap, another on rollback; and half of them run in a pool of their own, drawn
from :func:`small_pools` (a pool no larger than a prompt, one an allocation empties, blocks of one or two slots), as
a campaign draws its pools: a run keeps its own pool otherwise.

The subset is a property of how a program was drawn, not of the program: a printed, saved or replayed program is
its calls, and replaying them does not ask which operations were drawn.
"""

from __future__ import annotations

import random
from typing import Callable, Mapping, Optional, Sequence

import attrs

from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.operation import Operation
from kvfuzz.program.operations import OPERATIONS

ALWAYS_ENABLED = ("admit", "step")
"""Operations every swarm keeps: admit is always enabled (so a program never runs out of calls), step makes the
written K/V real."""

EVERYTHING = 0.25
"""The share of draws that keep every operation."""

KEEP = 0.5
"""The chance that any other operation is kept in a draw that does not keep everything."""

WEIGHTS: Mapping[str, float] = {
    "admit": 3.0,
    "grow": 2.0,
    "decode": 2.0,
    "rollback": 3.0,
    "evict": 0.5,
    "evict_blocks": 0.5,
    "reset_cache": 0.5,
    "misuse": 0.5,
}
"""An operation's weight in a swarm before the swarm's own factor (1 for one not named): the calls that build the
state deep bugs need (requests, their tokens, their cached prefixes) above the cheap ones that empty the cache
or only probe the contract, which the table has more of."""

FACTORS = (0.25, 1.0, 1.0, 4.0)
"""The factor a swarm draws for each operation it keeps, uniformly from these."""

SMALL_POOLS = (2, 3, 4, 5, 6, 8, 12, 16)
"""The device pools (in blocks) a run's swarm may draw below the run's own: deep slips need a pool no larger than a
prompt, or one whose allocations recycle cached blocks or refuse swap-ins, which a pool of 16 rarely is."""

SMALL_BLOCK_SIZES = (2,)
"""The block sizes a run's swarm may draw below the run's own (a rejected draft fills a block of two slots)."""

OWN_POOL = 0.5
"""The share of a run's swarms that keep the run's own pool (when it has smaller ones to draw)."""


@attrs.frozen
class Swarm:
    """The operations one random program may call (always including :data:`ALWAYS_ENABLED`, in the table's order) and
    how often each is chosen among those enabled: ``weights[i]`` is ``operations[i]``'s (positive); and the pool it
    runs in (``config``, None: the run's own)."""

    operations: tuple[Operation, ...]
    weights: tuple[float, ...]
    config: Optional[MachineConfig] = None

    def names(self) -> tuple[str, ...]:
        return tuple(operation.name for operation in self.operations)


def draw_operations(rng: random.Random, operations: Sequence[Operation] = OPERATIONS) -> tuple[Operation, ...]:
    """A subset of ``operations`` in their order: those of :data:`ALWAYS_ENABLED`, and each other one with
    probability :data:`KEEP`, or every one with probability :data:`EVERYTHING`."""
    everything = rng.random() < EVERYTHING
    return tuple(
        operation for operation in operations if operation.name in ALWAYS_ENABLED or everything or rng.random() < KEEP
    )


def draw_swarm(
    rng: random.Random, operations: Sequence[Operation] = OPERATIONS, pools: Sequence[MachineConfig] = ()
) -> Swarm:
    """A subset of ``operations`` as :func:`draw_operations` draws it, each kept one weighted by its :data:`WEIGHTS`
    times a factor drawn from :data:`FACTORS`; with ``pools`` (:func:`small_pools`), one of them, uniformly, in all
    but :data:`OWN_POOL` of the draws."""
    kept = draw_operations(rng, operations)
    weights = tuple(WEIGHTS.get(operation.name, 1.0) * rng.choice(FACTORS) for operation in kept)
    config = rng.choice(pools) if pools and rng.random() >= OWN_POOL else None
    return Swarm(kept, weights, config)


def small_pools(base: MachineConfig, builds: Callable[[MachineConfig], bool]) -> tuple[MachineConfig, ...]:
    """The pools a run's swarm may draw besides ``base``, the run's own: ``base`` with a smaller device pool of
    :data:`SMALL_POOLS` blocks, at its block size and at each of :data:`SMALL_BLOCK_SIZES` below it, for each block
    size from the smallest pool the factory ``builds`` (asked in ascending order, until one is built; the larger ones
    are taken to build too, as a campaign takes them). Host blocks, model and in-flight window stay ``base``'s. None
    for a block size whose pools the factory builds none of."""
    pools: list[MachineConfig] = []
    for block_size in sorted({size for size in SMALL_BLOCK_SIZES if size < base.block_size} | {base.block_size}):
        counts = [count for count in SMALL_POOLS if count < base.num_blocks]
        counts += [base.num_blocks] if block_size < base.block_size else []  # the run's pool, in smaller blocks
        smallest = next(
            (
                index
                for index, count in enumerate(counts)
                if builds(attrs.evolve(base, block_size=block_size, num_blocks=count))
            ),
            len(counts),
        )
        pools += [attrs.evolve(base, block_size=block_size, num_blocks=count) for count in counts[smallest:]]
    return tuple(pools)
