"""The liveness check: no request is left unserved while the step left it room (``Check.LIVENESS``).

The progress check bounds the drain once arrivals stop. This one holds every step, arrivals or not, to two promises
of vLLM's scheduler, each stated so that a request it names could have been served by that step alone (so a
legitimate wait, for blocks, budget or a running slot, is never one):

* **Running requests are served.** A step that leaves token budget unspent (fewer scheduled tokens than
  ``max_num_scheduled_tokens``, and more than a request's draft slots of ``max_num_batched_tokens`` left) has
  visited every running request, so it schedules every one it did not preempt. Exempt, for reasons the engine's
  own state shows (:class:`~kvfuzz.scheduler.oracles.engine.VllmView`): a request whose last output is already in
  flight (async scheduling), one at ``max_model_len``, a Mamba prefill chunk the align mode cuts, a connector's
  pending block frees.
* **The waiting queue's head is admitted when it fits.** Where the step preempted nothing, the first waiting request in
  the policy's order (:mod:`~kvfuzz.scheduler.oracles.queues`) that nothing holds back
  (:mod:`~kvfuzz.scheduler.oracles.holds`) and that the step did not admit is one the step had no room for: after the
  step, ``max_num_seqs`` requests run (``max_num_active_seqs``, where set), or the token budget left is below one token
  and the drafts a decode is padded to (with chunked prefill off, below all its tokens), or the pool's free blocks (the
  accounting check holds that count to the tables) are fewer than the watermark plus the blocks the whole request needs
  (its tokens, the lookahead slots and the drafts it may be padded to, with no prefix-cache hit: an upper bound of what
  vLLM allocates for its first chunk). Held for models of full attention alone; a sliding window's admission cap and a
  Mamba group's state blocks make the blocks a request needs something this bound does not capture, so hybrid models are
  held to the first promise only. So are configurations with a KV connector: the connector decides each step, from state
  only it holds, whether a request may start (its answer to ``get_num_new_matched_tokens``: "ask again later" while a
  transfer of the request is in flight, or an asynchronous load, which vLLM admits only if its blocks fit beside what
  the loads in flight still need)."""

from __future__ import annotations

from typing import Callable, Optional

import attrs

from kvfuzz.scheduler.async_batches import DEPTH
from kvfuzz.scheduler.oracles.budgets import Budgets
from kvfuzz.scheduler.oracles.engine import VllmView
from kvfuzz.scheduler.oracles.events import StepEvents
from kvfuzz.scheduler.oracles.holds import Holds
from kvfuzz.scheduler.oracles.queues import Queues
from kvfuzz.scheduler.violations import Check, SchedulerViolation


@attrs.frozen
class Room:
    """What a step left: its unspent token budget and input slots, and the pool's free blocks after it."""

    tokens: int
    input_slots: int
    free_blocks: int


def room_left(budgets: Budgets, events: StepEvents, view: VllmView) -> Room:
    return Room(
        budgets.max_num_scheduled_tokens - events.total,
        budgets.max_num_batched_tokens - budgets.input_tokens(events),
        view.free_blocks(),
    )


def check_running_served(
    budgets: Budgets,
    queues: Queues,
    events: StepEvents,
    view: VllmView,
    room: Room,
    known_tokens: Callable[[str], int],
) -> None:
    """Every running request (``queues.running``: before the step's admissions, victims and finished requests gone)
    that has a token to compute (``known_tokens``: its prompt and the outputs reported for it so far, more than
    vLLM has computed) is scheduled by a step that left budget unspent. One whose every known token is computed
    waits for its next token from an output: a model runner that never delivers it is the progress check's."""
    if room.tokens <= 0 or room.input_slots <= budgets.draft_slots:
        return
    for request in queues.running:
        if request in events.scheduled or view.running_exempt(request) is not None:
            continue
        if view.computed(request) >= known_tokens(request):
            continue
        raise SchedulerViolation(
            Check.LIVENESS,
            events.step,
            request,
            f"the step leaves it running without scheduling it, though it left {room.tokens} of "
            f"max_num_scheduled_tokens {budgets.max_num_scheduled_tokens} unspent ({events.total} scheduled: "
            f"{_listed(events)}): a step with budget to spare visits every running request, and schedules each "
            "it does not preempt",
            "a running request left unscheduled with budget to spare",
        )


def check_head_admitted(
    budgets: Budgets,
    queues: Queues,
    events: StepEvents,
    view: VllmView,
    room: Room,
    holds: Holds,
    known_tokens: Callable[[str], int],
    block_size: int,
    drafts: int,
) -> None:
    """The first waiting request (``queues.waiting``, before the step's admissions) that nothing holds back and the
    step did not admit had no room left by the step (``known_tokens``: a request's prompt and outputs reported so
    far; ``drafts``: the most drafts a request is scheduled a step)."""
    if events.preempted:
        return
    head = _head(queues, events, holds)
    if head is None:
        return
    running = len(queues.running) + len(events.admitted)
    if running >= budgets.max_num_active_seqs:
        return
    tokens = known_tokens(head)
    # a resumed decode may be padded to its drafts, or not scheduled at all; with chunked prefill off, a request is
    # admitted with all it has left (at most its every token) or not at all
    padded = 1 + drafts if budgets.chunked_prefill else tokens + drafts
    if room.tokens < padded or room.input_slots - budgets.draft_slots < padded:
        return
    slack = DEPTH * (1 + drafts) if view.async_scheduling else 0  # outputs in flight, not yet reported
    needed = -(-(tokens + slack + view.lookahead + drafts) // block_size) + view.watermark
    if room.free_blocks < needed:
        return
    raise SchedulerViolation(
        Check.LIVENESS,
        events.step,
        head,
        f"it is first in the waiting queue ({', '.join(queues.waiting)}, in the policy's order) and the step did "
        f"not admit it, though the step left room for all of it: {running} of {budgets.running_cap} running, "
        f"{room.tokens} of the token budget unspent, {room.free_blocks} free blocks where its "
        f"{tokens} tokens need at most {needed}"
        + (f" (watermark {view.watermark} included)" if view.watermark else "")
        + ": the scheduler admits the waiting queue's head whenever it fits",
        "a waiting request not admitted though it fit",
    )


def _head(queues: Queues, events: StepEvents, holds: Holds) -> Optional[str]:
    """The first waiting request the step did not admit and nothing held back (None: none)."""
    for request in queues.waiting:
        if request in events.admitted:
            holds.admitted(request)
        elif holds.reason(request) is None:
            return request
    return None


def _listed(events: StepEvents) -> str:
    return ", ".join(f"{request}: {count}" for request, count in events.scheduled.items()) or "nothing"
