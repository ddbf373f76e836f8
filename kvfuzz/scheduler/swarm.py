"""Swarm testing over the engine's configuration: each batch of a scheduler campaign draws its own configuration,
one value per row of :data:`DIMENSIONS` (rows, their draws and pins: :mod:`kvfuzz.swarm_table`), as allocator
campaigns draw their pools (:mod:`kvfuzz.campaign.swarm`).

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
from typing import Any, Callable, Mapping, Optional

import attrs

from kvfuzz.scheduler.config import DRAFTERS, LOAD_FAILURE_POLICIES, POLICIES, RETENTIONS, SchedulerSetup
from kvfuzz.swarm_table import (
    NO_PINS,
    Dimension,
    biased_small,
    chance,
    draw_values,
    fixed,
    split,
    uniform,
    weighted,
    weighted_choice,
)

MODEL_RUNNER = "model_runner"
"""The row that draws vLLM's model runner protocol (``V1`` or ``V2``): selected through vLLM's environment, not the
setup."""


BOOLEAN = (False, True)

DRAFTED = frozenset((1, 2, 4))
"""The ``speculative_tokens`` values with drafts: the drafter row means something only with them."""

SEVERAL = frozenset((2, 3, 4, 6, 8, 16))
"""The ``max_num_seqs`` values an admission cap of 1 or 2 (``max_num_active_seqs``) fits under."""

CAPPED = frozenset((1, 2, 3, 4, 8))
"""The ``long_prefill_token_threshold`` values that cap: the adaptive row means something only with them."""

DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("num_blocks", (3, 4, 6, 8, 12, 16, 24, 32, 64), biased_small),  # tiny pools preempt often
    Dimension("block_size", (1, 2, 4, 8, 16), uniform),
    Dimension("max_num_batched_tokens", (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128), biased_small),  # chunked prefill
    Dimension("max_num_seqs", (1, 2, 3, 4, 6, 8, 16), biased_small),
    Dimension("prefix_caching", BOOLEAN, chance(0.75)),
    Dimension("policy", POLICIES, uniform),  # FCFS, or priority (preemption by priority)
    # a sliding window beside full attention (two KV-cache groups) a seventh of the time; a Mamba group beside
    # attention a seventh (async too; redrawn only with drafts); chunked local attention beside full attention a
    # seventh; two sliding-window groups beside a full-attention one a seventh; R-SWA a seventh
    # (docs/scheduler-models.md)
    Dimension(
        "model",
        ("full", "sliding-window", "mamba-hybrid", "chunked-local", "sliding-window-groups", "rswa"),
        weighted_choice((2, 1, 1, 1, 1, 1)),
        stratified=True,
    ),
    Dimension("async_scheduling", BOOLEAN, chance(0.5)),  # two batches in flight, the released-block check
    Dimension("speculative_tokens", (0, 1, 2, 4), weighted((3, 1, 1, 1))),  # k drafts (under async: V2 runner only)
    Dimension("cache_salts", BOOLEAN, chance(0.25)),  # requests under cache salts: hits must not cross them
    Dimension("stop_tokens", BOOLEAN, chance(0.25)),  # requests that stop early (less pool pressure)
    Dimension("eos", BOOLEAN, chance(0.25)),  # requests ending at EOS, or ignoring it
    Dimension("min_tokens", BOOLEAN, chance(0.25)),  # stop tokens and EOS masked before min_tokens
    # vLLM's OffloadingConnector 1 time in 5, refused (and redrawn) under async scheduling or a hybrid model;
    # kvfuzz's P/D connector 1 time in 5 (refused with the sliding window and chunked local attention), with async
    # scheduling vLLM's deferred frees; with either, late transfers (docs/scheduler-connectors.md)
    Dimension("kv_connector", ("none", "offloading", "pd"), split(0.4, 0.2), stratified=True),
    Dimension("transfer_delay", (0, 1, 2, 3), weighted((2, 1, 1, 1)), needs=("kv_connector", ("offloading", "pd"))),
    # failed loads half the time with the P/D connector (on the Mamba hybrid whole only); with the offloading
    # connector only when pinned (--pin load_failures=true): vLLM's own worker for it never reports one, and the
    # scheduler's generic recovery then hangs (docs/scheduler-connectors.md)
    Dimension("load_failures", BOOLEAN, chance(0.5), needs=("kv_connector", "pd")),
    # LoRA: max_loras 1 or 2 half the time, requests drawn with one of max_loras + 1 adapters (the limit bites) or none
    Dimension("max_loras", (0, 1, 2), weighted((2, 1, 1))),
    # the client resets the prefix cache a quarter of the time (refused, and redrawn, with a KV connector), vLLM's
    # KV cache events checked against the pool half the time, requests past max_model_len a quarter
    # (docs/scheduler-features.md)
    Dimension("prefix_resets", BOOLEAN, chance(0.25)),
    Dimension("kv_events", BOOLEAN, chance(0.5)),
    Dimension("overlong_requests", BOOLEAN, chance(0.25)),
    Dimension("stats", BOOLEAN, chance(0.5)),  # vLLM's scheduler stats (log_stats), checked half the time
    # partial prefix caching: prefix hashes every 1 or 2 tokens half the time a Mamba hybrid is drawn (refused, and
    # redrawn, without prefix caching or with a block no larger than the unit; docs/scheduler-features.md); stratified,
    # as it runs the block pool's partial entries and their copies, which a guided campaign's fresh draws otherwise
    # met with the KV cache events or a connector in none of 104 batches
    Dimension("prefix_match_unit", (0, 1, 2), weighted((2, 1, 1)), needs=("model", "mamba-hybrid"), stratified=True),
    # resumable requests (streaming sessions) a quarter of the time, with synchronous scheduling and no connector
    # only (refused, and redrawn, with drafts; docs/scheduler-features.md)
    Dimension(
        "sessions", BOOLEAN, chance(0.25), needs=("async_scheduling", False), also_needs=("kv_connector", "none")
    ),
    Dimension("schedule_conservativeness", (1.0,), fixed),  # SGLang's alone (its table draws it)
    Dimension(MODEL_RUNNER, ("V1", "V2"), uniform),
    # how vLLM is told the drafts are made, with drafts: n-gram half the time, a draft model (one draft slot a
    # request, k lookahead slots) a quarter, a parallel one (k draft slots; vLLM 0.33.0's V1 runner only, refused and
    # redrawn elsewhere) a quarter (docs/scheduler-async.md#drafting-slots)
    Dimension("drafter", DRAFTERS, weighted((2, 1, 1, 1, 1)), needs=("speculative_tokens", DRAFTED)),
    # with the KV cache events, full reports (kv_cache_report_mode "full") for half the requests half the time
    Dimension("kv_events_full", BOOLEAN, chance(0.5), needs=("kv_events", True)),
    # vLLM's long-prefill cap (a request's tokens a step, beside others) half the time (refused, and redrawn, above
    # max_model_len), floored at the budget's fair share half of those; its admission cap a third of the time where
    # max_num_seqs leaves room for one below it
    Dimension("long_prefill_token_threshold", (0, 1, 2, 3, 4, 8), weighted((5, 1, 1, 1, 1, 1))),
    Dimension(
        "long_prefill_token_threshold_adaptive", BOOLEAN, chance(0.5), needs=("long_prefill_token_threshold", CAPPED)
    ),
    Dimension("max_num_active_seqs", (0, 1, 2), weighted((4, 1, 1)), needs=("max_num_seqs", SEVERAL)),
    # vLLM's prefill cadence: prefill every 2 or 3 executed steps while a decode runs, a third of the time
    Dimension("prefill_schedule_interval", (1, 2, 3), weighted((4, 1, 1))),
    # the client pauses and unpauses the scheduler a quarter of the time (refused, and redrawn, with sessions)
    Dimension("pauses", BOOLEAN, chance(0.25), needs=("sessions", False)),
    # with failed loads, vLLM's "fail" policy a third of the time: a request whose load failed finishes with an error
    Dimension("load_failure_policy", LOAD_FAILURE_POLICIES, weighted((2, 1)), needs=("load_failures", True)),
    # a quarter of the requests skip reading the prefix cache, a quarter of the time (kvfuzz.scheduler.prefix_reads)
    Dimension("skip_prefix_reads", BOOLEAN, chance(0.25)),
    # vLLM's prefix-cache retention of sliding-window and Mamba blocks: dense a quarter of the time, periodic (sliding
    # windows only; refused, and redrawn, on the Mamba hybrid) a quarter, vLLM's default (semantic) the rest
    Dimension(
        "retention",
        RETENTIONS,
        weighted((2, 1, 1)),
        needs=("model", ("sliding-window", "mamba-hybrid", "sliding-window-groups")),
    ),
    # vLLM's chunked prefill off a quarter of the time (max_model_len capped at the budget), where no long-prefill cap
    # splits prompts anyway; refused, and redrawn, on a Mamba hybrid with prefix caching (vLLM asserts it on there)
    Dimension("chunked_prefill", (True, False), chance(0.25), needs=("long_prefill_token_threshold", 0)),
    # on a Mamba hybrid with prefix caching, its Mamba layers export prefill checkpoints (as vLLM's Mamba2 mixer does)
    # half the time; refused, and redrawn, with drafts (kvfuzz.scheduler.mamba_checkpoints)
    Dimension(
        "mamba_checkpoints", BOOLEAN, chance(0.5), needs=("model", "mamba-hybrid"), also_needs=("prefix_caching", True)
    ),
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
    model_runner: str  # "V1" or "V2" ("" for an engine without one: SGLang)
    steps: int  # operations per example, before the drain
    refused: int  # configurations drawn and refused (by SchedulerSetup or vLLM) before this one

    def describe(self) -> str:
        runner = f", {self.model_runner} model runner" if self.model_runner else ""
        return f"{self.setup.describe()}{runner}, up to {self.steps} operations"

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self.setup), MODEL_RUNNER: self.model_runner, "steps": self.steps}


class NothingValid(Exception):
    """The validator refused every configuration drawn."""


def draw(
    rng: random.Random,
    valid: Callable[[SchedulerSetup, str], None],
    dimensions: Optional[tuple[Dimension, ...]] = None,
    pins: Mapping[str, Any] = NO_PINS,
) -> SwarmConfig:
    """A configuration of ``dimensions`` (vLLM's table unless another engine's is given) ``valid`` accepts (it raises
    ``ValueError`` for one the engine refuses); ``rng`` alone decides it, so a seed draws the same configurations. A
    row named in ``pins`` takes its pinned value (its draw is made all the same, so the other rows draw what they
    would unpinned). Raises :class:`NothingValid` after :data:`MAX_REDRAWS` refusals."""
    last: Optional[ValueError] = None
    rows = DIMENSIONS if dimensions is None else dimensions  # the table as the module holds it now
    for refused in range(MAX_REDRAWS):
        values = draw_values(rng, rows, pins)
        runner = values.pop(MODEL_RUNNER)
        steps = rng.choice(STEPS)
        try:
            setup = SchedulerSetup(**values)
            valid(setup, runner)
        except ValueError as error:
            last = error
            continue
        return SwarmConfig(setup, runner, steps, refused)
    raise NothingValid(f"{MAX_REDRAWS} configurations drawn, every one refused (the last: {last})")
