"""Swarm testing over the engine's configuration: each batch of a scheduler campaign draws its own configuration,
one value per row of :data:`DIMENSIONS`, as allocator campaigns draw their pools (:mod:`kvfuzz.campaign.swarm`).

No single configuration reaches every path of the scheduler: preemption needs a small pool or many running
requests, chunked prefill meeting a prefix hit needs a token budget below the prompts, a cache hit needs prefix
caching on, the V1 model runner's protocol resumes a preempted request among the cached ones and V2's as a new one,
and only async scheduling has a block released while a step that reads it is still in flight.

The table has one row per dimension: the field of :class:`~kvfuzz.scheduler.config.SchedulerSetup` it sets (or
:data:`MODEL_RUNNER`, the protocol vLLM selects from its environment, which is not part of the setup) and how it is
drawn. A new field of ``SchedulerSetup`` is swarmed by adding its row here. vLLM's own validation refuses some
combinations (a token budget below the running-request cap, say): :func:`draw` redraws until the validator accepts
one, and counts the refusals, so a campaign runs only configurations vLLM would run.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import attrs

from kvfuzz.scheduler.config import POLICIES, SchedulerSetup

MODEL_RUNNER = "model_runner"
"""The row that draws vLLM's model runner protocol (``V1`` or ``V2``): selected through vLLM's environment, not the
setup."""


@attrs.frozen
class Dimension:
    """One row of the swarm table: ``name`` (a ``SchedulerSetup`` field, or :data:`MODEL_RUNNER`) drawn by
    ``draw``."""

    name: str
    draw: Callable[[random.Random], Any]


def _biased_small(values: tuple[int, ...]) -> Callable[[random.Random], int]:
    """A value of ``values`` (ascending), the small ones more often: the first half of the list twice as likely."""
    return lambda rng: values[min(int(rng.random() ** 1.5 * len(values)), len(values) - 1)]


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("num_blocks", _biased_small((3, 4, 6, 8, 12, 16, 24, 32, 64))),  # tiny pools preempt often
    Dimension("block_size", lambda rng: rng.choice((1, 2, 4, 8, 16))),
    Dimension("max_num_batched_tokens", _biased_small((1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128))),  # chunked prefill
    Dimension("max_num_seqs", _biased_small((1, 2, 3, 4, 6, 8, 16))),
    Dimension("prefix_caching", lambda rng: rng.random() < 0.75),
    Dimension("policy", lambda rng: rng.choice(POLICIES)),  # FCFS, or priority (preemption by priority)
    # a sliding window beside full attention (two KV-cache groups) a quarter of the time
    Dimension("model", lambda rng: "sliding-window" if rng.random() < 0.25 else "full"),
    Dimension("async_scheduling", lambda rng: rng.random() < 0.5),  # two batches in flight, the released-block check
    Dimension("speculative_tokens", lambda rng: rng.choice((0, 0, 0, 1, 2, 4))),  # k drafts (not under async)
    Dimension("cache_salts", lambda rng: rng.random() < 0.25),  # requests under cache salts: hits must not cross them
    Dimension("stop_tokens", lambda rng: rng.random() < 0.25),  # requests that stop early (less pool pressure)
    Dimension(MODEL_RUNNER, lambda rng: rng.choice(("V1", "V2"))),
)
"""The engine's configuration, one row per dimension (add a row for a new ``SchedulerSetup`` field)."""

STEPS = (10, 25, 50, 100)
"""Operations per example a batch draws (before the drain): short programs shrink fast, long ones reach deep
states."""

MAX_REDRAWS = 1000
"""Draws before :func:`draw` gives up: a validator that refuses this many in a row refuses (nearly) everything."""


@attrs.frozen
class SwarmConfig:
    """One batch's draw: the setup, the model runner protocol, the operations per example, and how many draws vLLM
    refused before this one."""

    setup: SchedulerSetup
    model_runner: str  # "V1" or "V2"
    steps: int  # operations per example, before the drain
    refused: int  # configurations drawn and refused (by SchedulerSetup or vLLM) before this one

    def describe(self) -> str:
        return f"{self.setup.describe()}, {self.model_runner} model runner, up to {self.steps} operations"

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self.setup), MODEL_RUNNER: self.model_runner, "steps": self.steps}


class NothingValid(Exception):
    """The validator refused every configuration drawn."""


def draw(rng: random.Random, valid: Callable[[SchedulerSetup, str], None]) -> SwarmConfig:
    """A configuration ``valid`` accepts (it raises ``ValueError`` for one vLLM refuses); ``rng`` alone decides it,
    so a seed draws the same configurations. Raises :class:`NothingValid` after :data:`MAX_REDRAWS` refusals."""
    for refused in range(MAX_REDRAWS):
        values = {dimension.name: dimension.draw(rng) for dimension in DIMENSIONS}
        runner = values.pop(MODEL_RUNNER)
        steps = rng.choice(STEPS)
        try:
            setup = SchedulerSetup(**values)
            valid(setup, runner)
        except ValueError:
            continue
        return SwarmConfig(setup, runner, steps, refused)
    raise NothingValid(f"{MAX_REDRAWS} configurations drawn, every one refused")
