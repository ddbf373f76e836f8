"""The scheduler's running and waiting queues as its policy defines them, rebuilt from the oracles' events alone.

* **running**, in admission order: a request admitted (new or resumed) joins its end; a preempted, finished or
  aborted one leaves it. vLLM's ``Scheduler.running`` is kept so (``running.append`` at admission).
* **waiting**, in the order the policy serves it:

  - FCFS: arrivals join the end; requests preempted together go back to the *front*, in their running order (vLLM
    preempts from the running queue's end and prepends each victim, and a client's prefix-cache reset does the same
    for every running request), ahead of every request already waiting;
  - priority: ordered by (priority, arrival), whatever happened to the request before.

Requests admitted in one step joined the running queue in the waiting queue's order (the policy serves the queue
from its front), which is how the model orders them: a step that admits out of that order fails the order check
first, so the model's running order is the engine's wherever the checks passed. The exception is a KV connector's
queue, which vLLM serves first (requests whose blocks a load filled): those join the running queue ahead of the
step's other admissions, in an order among themselves the model does not know (``unordered``)."""

from __future__ import annotations

from typing import Iterable

from kvfuzz.scheduler.oracles.events import Arrival, StepEvents


class Queues:
    """The queues of one example under FCFS. Invariant: every unfinished request the client added is in exactly one
    of ``running`` and ``waiting``; ``arrivals`` holds every request ever added."""

    policy = "fcfs"

    def __init__(self) -> None:
        self.arrivals: dict[str, Arrival] = {}  # request -> how its client added it
        self.running: list[str] = []  # in admission order
        self.waiting: list[str] = []  # in the order the policy serves it
        # requests admitted together from a KV connector's queue, whose order among themselves in ``running`` is unknown
        self.unordered: list[frozenset[str]] = []

    def added(self, arrival: Arrival) -> None:
        self.arrivals[arrival.request] = arrival
        self.waiting.append(arrival.request)

    def victims_in_order(self, preempted: Iterable[str]) -> list[str]:
        """The preempted requests that were running, in running order."""
        chosen = set(preempted)
        return [request for request in self.running if request in chosen]

    def serving_order(self, waiting: Iterable[str]) -> list[str]:
        """``waiting`` in the order the policy serves it: as given under FCFS."""
        return list(waiting)

    def requeue(self, victims: list[str]) -> None:
        """FCFS: the step's victims go back to the front of the waiting queue, in running order."""
        self.waiting = victims + self.waiting

    def before_admissions(self, events: StepEvents) -> None:
        """The step up to its admissions: finished and aborted requests leave both queues, victims leave the running
        queue for the waiting queue."""
        self.running = [request for request in self.running if request not in events.finished]
        self.waiting = [request for request in self.waiting if request not in events.finished]
        victims = self.victims_in_order(events.preempted)
        self.running = [request for request in self.running if request not in events.preempted]
        self.waiting = [request for request in self.waiting if request not in events.preempted]
        self.requeue(victims)
        self.waiting = self.serving_order(self.waiting)

    def admit(self, events: StepEvents, ahead: frozenset[str] = frozenset()) -> None:
        """The step's admissions leave the waiting queue for the running queue's end, in waiting order, those served
        from a KV connector's queue (``ahead``) first."""
        admitted = [request for request in self.waiting if request in events.admitted]
        first = [request for request in admitted if request in ahead]
        self.waiting = [request for request in self.waiting if request not in events.admitted]
        self.running.extend(first + [request for request in admitted if request not in ahead])
        running = set(self.running)
        self.unordered = [group & running for group in self.unordered if len(group & running) > 1]
        if len(first) > 1:
            self.unordered.append(frozenset(first))

    def unordered_with(self, request: str) -> frozenset[str]:
        """The running requests whose order relative to ``request`` the model does not know."""
        return frozenset().union(*(group for group in self.unordered if request in group))


class PriorityQueues(Queues):
    """The queues under the priority policy: the waiting queue ordered by (priority, arrival)."""

    policy = "priority"

    def key(self, request: str) -> tuple[int, int]:
        """The policy's order: smaller priority first, then earlier arrival (the victim is the largest)."""
        arrival = self.arrivals[request]
        return arrival.priority, arrival.arrival

    def serving_order(self, waiting: Iterable[str]) -> list[str]:
        return sorted(waiting, key=self.key)

    def requeue(self, victims: list[str]) -> None:
        self.waiting = self.serving_order(self.waiting + victims)

    def added(self, arrival: Arrival) -> None:
        super().added(arrival)
        self.waiting = self.serving_order(self.waiting)


def queues_for(policy: str) -> Queues:
    """The queue model of ``policy`` (``fcfs`` or ``priority``)."""
    return PriorityQueues() if policy == "priority" else Queues()
