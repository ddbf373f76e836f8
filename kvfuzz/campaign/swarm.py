"""Swarm testing over configurations: every program of a campaign draws its own pool geometry, program length and
subset of operations, within what the allocator accepts.

No single setting finds every bug: a stale-cache bug needs a pool of a few blocks, an accounting drift a long
program, a rollback slip a program where swap is left out so that rollbacks come often. A campaign therefore draws,
for each batch of programs, a :class:`SwarmConfig`: the number of blocks (biased toward tiny pools, reaching
large ones), the block size, the host blocks, the in-flight window W (for a factory that builds the W it is asked
for, as kvfuzz's own do), the program length (a few calls to a few hundred) and a random subset of the operation
table (every operation the table has, so a new operation is swarmed as soon as it is added).

What an allocator accepts (:class:`Limits`) is found by asking its factory for pools before the campaign starts:
block sizes and pool sizes whose allocator the factory refuses to build, or builds with another geometry, are never
drawn. The table's rows (:func:`allocator_rows`) are rows of :mod:`kvfuzz.swarm_table`, as a scheduler's are:
``--pin ROW=VALUE`` holds one at a value (``--pin block_size=1``, ``--pin operations=admit,step,swap``).
"""

from __future__ import annotations

import random
from typing import Any, Mapping, Optional

import attrs

from kvfuzz.allocator.types import PoolSpec
from kvfuzz.campaign.known import Recorded
from kvfuzz.engine.config import MachineConfig, config_json
from kvfuzz.engine.operation import Operation
from kvfuzz.program.operations import BY_NAME, OPERATIONS
from kvfuzz.program.swarm import ALWAYS_ENABLED, draw_operations
from kvfuzz.registry import AllocatorFactory, AllocatorNotFound, AllocatorUnusable, builds, probe_allocator
from kvfuzz.swarm_table import NO_PINS, Dimension, Subset, draw_values, uniform

BLOCK_SIZES = (1, 2, 4, 8, 16)
"""The block sizes a campaign tries; those the allocator does not build are left out."""

MAX_BLOCKS = 256
"""The largest device pool a campaign draws (a few kilobytes of K/V per block in the default model shape)."""

MAX_HOST_BLOCKS = 32
MAX_WINDOW = 3
"""The largest in-flight window W a campaign asks of a factory that builds the W it is asked for."""
MAX_PROGRAM_LENGTH = 300


@attrs.frozen
class Limits:
    """What one allocator factory builds, found by probing it: the block sizes it accepts (never empty), the
    smallest pool, and the capabilities it declares (its in-flight window W among them)."""

    allocator: str  # the spec the campaign was given
    block_sizes: tuple[int, ...]  # accepted block sizes, ascending
    min_blocks: int  # the smallest device pool the factory builds
    declared_window: int  # the W the allocator declares when asked for none
    host_blocks: bool  # whether it keeps the host blocks it is given (swap is possible)
    host_cache: bool = False  # whether it declares host_cache: then every pool drawn has host blocks
    windows: tuple[int, ...] = ()  # the W values its factory builds when asked (PoolSpec.inflight_window), if any


@attrs.frozen
class SwarmConfig:
    """The configuration of one batch of programs: the allocator (one of the campaign's set), the machine
    configuration, the program length and the operations its programs may call (always including
    :data:`~kvfuzz.program.swarm.ALWAYS_ENABLED`, in the table's order)."""

    allocator: str  # spec of the allocator factory
    machine: MachineConfig  # pool geometry (and the campaign's model shape and kernel)
    program_length: int  # calls per program
    operations: tuple[str, ...]  # names from the operation table

    def operation_records(self) -> tuple[Operation, ...]:
        """The table entries of :attr:`operations` (names the table no longer has are dropped)."""
        return tuple(BY_NAME[name] for name in self.operations if name in BY_NAME)

    def to_json(self) -> dict[str, object]:
        """What a trace records of the swarm (the geometry is in the trace's config)."""
        return {"program_length": self.program_length, "operations": list(self.operations)}

    def recorded(self) -> Recorded:
        """The configuration, as the closeness of a known trace's to it is measured."""
        return recorded(self.allocator, self.machine)

    def describe(self) -> str:
        machine = self.machine
        window = "" if machine.inflight_window is None else f", W = {machine.inflight_window}"
        return (
            f"{machine.num_blocks} blocks x {machine.block_size} slots, {machine.num_host_blocks} host blocks{window}, "
            f"{self.program_length} calls over {', '.join(self.operations)}"
        )


def recorded(allocator: str, machine: MachineConfig) -> Recorded:
    """An allocator's configuration as the closeness of two is measured (:class:`~kvfuzz.campaign.known.Recorded`):
    the allocator, then the pool and model fields."""
    return Recorded(allocator, config_json(machine, machine.inflight_window))


def probe_limits(spec: str, factory: AllocatorFactory, base: MachineConfig) -> Limits:
    """Ask ``factory`` for pools of each :data:`BLOCK_SIZES` and for a one-block pool; raises
    :class:`AllocatorUnusable` (or :class:`AllocatorNotFound`) when it builds none of them, with the reason the
    default geometry was refused."""
    accepted: list[int] = []
    refusal: Optional[Exception] = None
    probe = None
    for block_size in BLOCK_SIZES:
        try:
            built = probe_allocator(spec, factory, PoolSpec(block_size, 16, 4))
        except AllocatorUnusable as error:
            if block_size == base.block_size or refusal is None:
                refusal = error
            continue
        accepted.append(block_size)
        if probe is None or block_size == base.block_size:
            probe = built
    if probe is None:
        assert refusal is not None
        raise refusal
    block_size = base.block_size if base.block_size in accepted else accepted[0]
    host_cache = probe.capabilities.host_cache
    min_blocks = next(
        (
            count
            for count in (1, 2, 3, 4, 6, 8, 16)
            if builds(spec, factory, PoolSpec(block_size, count, 4 if host_cache else 0))
        ),
        16,
    )
    return Limits(
        spec,
        tuple(accepted),
        min_blocks,
        probe.capabilities.inflight_window,
        getattr(probe, "num_host_blocks", 0) > 0,
        host_cache,
        _windows(spec, factory, block_size),
    )


def _windows(spec: str, factory: AllocatorFactory, block_size: int) -> tuple[int, ...]:
    """The W values 0 .. :data:`MAX_WINDOW` that ``factory`` builds when asked for them, if it builds every one
    (kvfuzz's own allocators); () for a factory whose allocator keeps its own W."""
    for window in range(MAX_WINDOW + 1):
        try:
            built = probe_allocator(spec, factory, PoolSpec(block_size, 16, 4, window))
        except (AllocatorUnusable, AllocatorNotFound):
            return ()
        if built.capabilities.inflight_window != window:
            return ()
    return tuple(range(MAX_WINDOW + 1))


NUM_BLOCKS, BLOCK_SIZE, HOST_BLOCKS, PROGRAM_LENGTH, OPERATIONS_ROW, WINDOW = (
    "num_blocks",
    "block_size",
    "host_blocks",
    "program_length",
    "operations",
    "window",
)
"""The rows of an allocator's swarm table, by name (``--pin num_blocks=4``)."""


def allocator_rows(limits: Limits) -> tuple[Dimension, ...]:
    """The swarm table of an allocator that builds what ``limits`` says, in the order its rows draw: the device pool
    (half the pools tiny, the smallest up to 6 blocks, most of the rest up to 32, one in five up to
    :data:`MAX_BLOCKS`), the block size, the host blocks (none a quarter of the time, unless the allocator declares a
    host cache; for one that keeps none, never), the program length (mostly short or medium, one in five long), the
    operations (as :func:`~kvfuzz.program.swarm.draw_operations` draws them) and, for a factory that builds the W it
    is asked for, W (0 and 1 twice as often as larger ones: a synchronous engine and one step in flight; W >= 2 for
    the deferred frees that outlive a step)."""
    low = limits.min_blocks
    if not limits.host_blocks:
        host_blocks: tuple[int, ...] = (0,)
    else:
        host_blocks = tuple(range(1 if limits.host_cache else 0, MAX_HOST_BLOCKS + 1))
    rows = (
        Dimension(NUM_BLOCKS, tuple(range(low, max(low, MAX_BLOCKS) + 1)), _pool_blocks),
        Dimension(BLOCK_SIZE, limits.block_sizes, uniform),
        Dimension(HOST_BLOCKS, host_blocks, _host_blocks),
        Dimension(PROGRAM_LENGTH, tuple(range(5, MAX_PROGRAM_LENGTH + 1)), _program_length),
        Subset(OPERATIONS_ROW, tuple(operation.name for operation in OPERATIONS), _operations, always=ALWAYS_ENABLED),
    )
    return rows + ((Dimension(WINDOW, limits.windows, _window),) if limits.windows else ())


def _pool_blocks(rng: random.Random, values: tuple[Any, ...]) -> Any:
    low, high = values[0], values[-1]
    roll = rng.random()
    if roll < 0.5:
        return rng.randint(low, max(low, 6))
    if roll < 0.8:
        return rng.randint(max(low, 7), max(low, 32))
    return rng.randint(max(low, 33), high)


def _host_blocks(rng: random.Random, values: tuple[Any, ...]) -> Any:
    roll = rng.random()
    if values == (0,) or (roll < 0.25 and values[0] == 0):
        return 0
    return rng.randint(1, 4) if roll < 0.75 else rng.randint(5, values[-1])


def _program_length(rng: random.Random, values: tuple[Any, ...]) -> Any:
    roll = rng.random()
    if roll < 0.4:
        return rng.randint(5, 30)
    return rng.randint(31, 100) if roll < 0.8 else rng.randint(101, values[-1])


def _operations(rng: random.Random, names: tuple[Any, ...]) -> Any:
    return tuple(operation.name for operation in draw_operations(rng, [BY_NAME[name] for name in names]))


def _window(rng: random.Random, values: tuple[Any, ...]) -> Any:
    return rng.choice((*values, *values[:2]))


PINNED_DRAWS = 100
"""Pinned configurations drawn before a campaign start: when the allocator builds the pool of none of them, the pins
are refused (one built is enough: the pinned rows then hold in every batch's draw)."""


def builds_pinned(
    limits: Limits, factory: AllocatorFactory, base: MachineConfig, pins: Mapping[str, Any], seed: int
) -> bool:
    """Whether ``factory`` builds the pool of one of :data:`PINNED_DRAWS` configurations drawn with ``pins``."""
    rng = random.Random(seed)
    for _ in range(PINNED_DRAWS):
        swarm = draw_swarm(rng, limits, base, pins)
        if builds(limits.allocator, factory, swarm.machine.pool_spec()):
            return True
    return False


def draw_swarm(
    rng: random.Random, limits: Limits, base: MachineConfig, pins: Mapping[str, Any] = NO_PINS
) -> SwarmConfig:
    """One configuration of the allocator's table (:func:`allocator_rows`), the rows named in ``pins`` held at their
    pinned values."""
    return _swarm(limits, base, draw_values(rng, allocator_rows(limits), pins))


ALLOCATOR = "allocator"
"""The field of :func:`swarm_values` naming the allocator (no row of the table is named so)."""


def swarm_values(swarm: SwarmConfig) -> dict[str, Any]:
    """The allocator and the table's row values of ``swarm``, as JSON: what a guided campaign keeps a seed's
    configuration as (:func:`swarm_of` reads it back)."""
    machine = swarm.machine
    values: dict[str, Any] = {
        ALLOCATOR: swarm.allocator,
        NUM_BLOCKS: machine.num_blocks,
        BLOCK_SIZE: machine.block_size,
        HOST_BLOCKS: machine.num_host_blocks,
        PROGRAM_LENGTH: swarm.program_length,
        OPERATIONS_ROW: list(swarm.operations),
    }
    return values if machine.inflight_window is None else {**values, WINDOW: machine.inflight_window}


def swarm_of(values: Mapping[str, Any], limits: Limits, base: MachineConfig) -> SwarmConfig:
    """The configuration :func:`swarm_values` wrote, for the allocator ``limits`` describes; ``ValueError`` when it
    is another allocator's, or a value is not one its row of this allocator's table draws (a seed written by another
    kvfuzz, or for a factory that builds other pools)."""
    if values.get(ALLOCATOR) != limits.allocator:
        raise ValueError(f"a configuration of {values.get(ALLOCATOR)!r}, not of {limits.allocator!r}")
    rows = allocator_rows(limits)
    if set(values) - {ALLOCATOR} != {row.name for row in rows}:
        raise ValueError(f"the rows {sorted(set(values) - {ALLOCATOR})} are not the table's")
    read: dict[str, Any] = {}
    for row in rows:
        value = values[row.name]
        if isinstance(row, Subset):
            names = tuple(value) if isinstance(value, list) else ()
            if not set(row.always) <= set(names) <= set(row.domain):
                raise ValueError(f"{row.name}: {value!r} is not a subset of the table's operations")
            read[row.name] = tuple(name for name in row.domain if name in names)
        elif type(value) is not int or value not in row.domain:
            raise ValueError(f"{row.name}: {value!r} is not a value the table draws")
        else:
            read[row.name] = value
    return _swarm(limits, base, read)


def _swarm(limits: Limits, base: MachineConfig, values: Mapping[str, Any]) -> SwarmConfig:
    machine = attrs.evolve(
        base,
        block_size=values[BLOCK_SIZE],
        num_blocks=values[NUM_BLOCKS],
        num_host_blocks=values[HOST_BLOCKS],
        inflight_window=values.get(WINDOW),
    )
    return SwarmConfig(limits.allocator, machine, values[PROGRAM_LENGTH], values[OPERATIONS_ROW])
