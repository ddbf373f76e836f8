"""What the policy oracles are fed: each request as its client added it, and each step as the model runner saw it.

The oracles (:mod:`kvfuzz.scheduler.oracles`) never walk the engine's queues to decide what the policy should have
done: they rebuild the queues from these events (:mod:`~kvfuzz.scheduler.oracles.queues`) and hold the step to them.
What they read of the engine is named where it is read (the pool's free count, which the accounting check already
holds to the tables; a request's own state where the engine skips it for a reason outside the policy)."""

from __future__ import annotations

from typing import Any, Collection, Mapping

import attrs


@attrs.frozen
class Arrival:
    """A request as its client added it: its id, its arrival ordinal (vLLM's ``arrival_time`` in the target), its
    priority (0 under FCFS), its LoRA adapter (0: none) and its prompt's length."""

    request: str
    arrival: int
    priority: int
    lora: int
    prompt_length: int


@attrs.frozen
class StepEvents:
    """One ``schedule()`` as the model runner reads its output: the tokens scheduled per request, the requests the
    step admitted from the waiting queue (new, or resumed after a preemption), those it (or a client's prefix-cache
    reset since the last step) preempted, those that finished or were aborted since the last step, and each
    scheduled request's computed tokens before the step, and the drafts (placeholders included) among each
    scheduled request's tokens.

    Invariant: ``admitted`` and ``preempted`` are disjoint from ``finished``; every admitted request is scheduled."""

    step: int
    scheduled: Mapping[str, int]
    admitted: frozenset[str]
    preempted: frozenset[str]
    finished: frozenset[str]
    computed: Mapping[str, int]
    drafts: Mapping[str, int] = attrs.field(factory=dict)  # scheduled request -> its drafts among its tokens

    @property
    def total(self) -> int:
        """The tokens the step scheduled."""
        return sum(self.scheduled.values())


def step_events(output: Any, resumed: Collection[str], computed: Mapping[str, int], step: int) -> StepEvents:
    """The events of a vLLM ``SchedulerOutput`` (``resumed``: its cached requests resumed after a preemption, the V1
    runner's protocol; ``computed``: the worker's computed tokens, before the step, of each scheduled request)."""
    admitted = {new.req_id for new in output.scheduled_new_reqs} | set(resumed)
    return StepEvents(
        step,
        dict(output.num_scheduled_tokens),
        frozenset(admitted),
        frozenset(output.preempted_req_ids or ()),
        frozenset(output.finished_req_ids),
        dict(computed),
        {request: len(drafts) for request, drafts in (output.scheduled_spec_decode_tokens or {}).items()},
    )
