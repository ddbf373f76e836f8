"""The order check: the scheduling policy's choices, held to what the policy promises (``Check.ORDER``).

* **Victims.** Under FCFS the requests a step preempts are the running requests admitted last (vLLM preempts from
  the end of its running queue): no running request admitted after a victim is left running. Under the priority
  policy each victim is the running request of the lowest priority (the largest value), the latest arrival among
  equals, so a step's victims are the running requests that come last in (priority, arrival): none of those left
  running comes after a victim.
* **Admissions.** A step admits waiting requests in the order the policy serves its waiting queue
  (:mod:`~kvfuzz.scheduler.oracles.queues`): under FCFS arrival order, with preempted requests back at the front,
  ahead of every request newer than them; under the priority policy (priority, arrival). A request ahead of an
  admitted one may be passed over only for a reason the policy allows (:mod:`~kvfuzz.scheduler.oracles.holds`: the
  LoRA limit, a KV connector's transfer, output still in flight from before its preemption).

What is not a promise, and not checked: that a step admits nobody after it preempted (vLLM's implementation choice);
the order in which requests resumed in one step are listed; SGLang's retraction order (it retracts by output
length, and puts the retracted requests at the end of its waiting queue)."""

from __future__ import annotations

from kvfuzz.scheduler.oracles.events import StepEvents
from kvfuzz.scheduler.oracles.holds import Holds
from kvfuzz.scheduler.oracles.queues import PriorityQueues, Queues
from kvfuzz.scheduler.violations import Check, SchedulerViolation


def check_victims(queues: Queues, events: StepEvents) -> None:
    """The step's victims against the running queue before it (``queues``, finished requests already gone)."""
    running = [request for request in queues.running if request not in events.finished]
    victims = [request for request in running if request in events.preempted]
    if not victims:
        return
    kept = [request for request in running if request not in events.preempted]
    if isinstance(queues, PriorityQueues):
        worst = max(kept, key=queues.key, default=None)
        first = min(victims, key=queues.key)
        if worst is not None and queues.key(worst) > queues.key(first):
            raise SchedulerViolation(
                Check.ORDER,
                events.step,
                first,
                f"the step preempts {_described(queues, victims)} but leaves {_described(queues, [worst])} running: "
                "under the priority policy the victim is the running request of the lowest priority (the largest "
                "value), then the latest arrival, and "
                f"{worst} comes after {first} in (priority, arrival)",
                "a priority victim other than the lowest-priority running request",
            )
        return
    first = min(victims, key=running.index)
    unknown = queues.unordered_with(first)  # admitted beside it from a KV connector's queue: their order is not known
    after = [request for request in kept if running.index(request) > running.index(first) and request not in unknown]
    if after:
        raise SchedulerViolation(
            Check.ORDER,
            events.step,
            first,
            f"the step preempts {', '.join(victims)} of the running requests {', '.join(running)} (in admission "
            f"order), but leaves {', '.join(after)} running, admitted after {first}: under FCFS the victims are the "
            "running requests admitted last",
            "an FCFS victim other than the last admitted",
        )


def check_admissions(queues: Queues, events: StepEvents, holds: Holds) -> None:
    """The step's admissions against the waiting queue before them (``queues`` after
    :meth:`~kvfuzz.scheduler.oracles.queues.Queues.before_admissions`)."""
    waiting = [request for request in queues.waiting if request not in holds.view.served_ahead]
    admitted = [request for request in waiting if request in events.admitted]
    if not admitted:
        return
    last = waiting.index(admitted[-1])
    for request in waiting[:last]:
        if request in events.admitted:
            holds.admitted(request)
            continue
        if holds.reason(request) is not None:
            continue
        later = [other for other in admitted if waiting.index(other) > waiting.index(request)]
        raise SchedulerViolation(
            Check.ORDER,
            events.step,
            later[0],
            f"the step admits {', '.join(later)} but not {request}, which is ahead of "
            f"{'it' if len(later) == 1 else 'them'} in the waiting queue ({_queue(queues)}), and nothing held "
            f"{request} back (not the LoRA limit, a KV connector, nor output in flight): {_promise(queues)}",
            "a waiting request admitted out of the policy's order",
        )


def _promise(queues: Queues) -> str:
    if isinstance(queues, PriorityQueues):
        return "under the priority policy waiting requests are admitted in (priority, arrival) order"
    return (
        "under FCFS waiting requests are admitted in arrival order, a preempted request back at the front, ahead "
        "of every request newer than it"
    )


def _described(queues: Queues, requests: list[str]) -> str:
    return ", ".join(
        f"{request} (priority {queues.arrivals[request].priority}, arrival {queues.arrivals[request].arrival})"
        for request in requests
    )


def _queue(queues: Queues) -> str:
    """The waiting queue in serving order, for a message."""
    if isinstance(queues, PriorityQueues):
        return "in (priority, arrival) order: " + _described(queues, queues.waiting)
    return "front first: " + ", ".join(queues.waiting)
