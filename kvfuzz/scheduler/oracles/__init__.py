"""The policy oracles: what vLLM's scheduler promises beyond KV-cache safety, each a checker of its own fed by the
same events (docs/oracles.md):

* :mod:`~kvfuzz.scheduler.oracles.order`: the policy's victims and its admission order;
* :mod:`~kvfuzz.scheduler.oracles.budgets`: each step within the token budgets, the running cap and
  ``max_model_len``, and with chunked prefill off no prompt split;
* :mod:`~kvfuzz.scheduler.oracles.liveness`: no running request left unscheduled with budget to spare, no waiting
  request left waiting while the step left it room.

Events flow one way: the session tells :class:`PolicyOracles` of each request its client adds and of each step once
the worker has read its output (and the accounting check has held the pool to the tables); the oracles rebuild the
policy's queues from them (:mod:`~kvfuzz.scheduler.oracles.queues`) and never change the engine."""

from __future__ import annotations

from typing import Any, Callable

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.oracles.budgets import Budgets, check_budgets, check_unsplit
from kvfuzz.scheduler.oracles.engine import VllmView
from kvfuzz.scheduler.oracles.events import Arrival, StepEvents, step_events
from kvfuzz.scheduler.oracles.holds import Holds
from kvfuzz.scheduler.oracles.liveness import check_head_admitted, check_running_served, room_left
from kvfuzz.scheduler.oracles.order import check_admissions, check_victims
from kvfuzz.scheduler.oracles.queues import queues_for
from kvfuzz.scheduler.pausing import Pausing

__all__ = ["Arrival", "PolicyOracles", "step_events"]

FULL_ATTENTION = "full"
"""The model whose blocks per request the head-admitted promise can bound (:mod:`.liveness`)."""


class PolicyOracles:
    """The pause, order, budget and liveness checks of one example (``known_tokens``: a request's prompt and the outputs
    reported for it so far, as the output ledger holds them)."""

    def __init__(
        self,
        setup: SchedulerSetup,
        config: Any,
        scheduler: Any,
        known_tokens: Callable[[str], int],
        pausing: Pausing,
    ) -> None:
        self.setup = setup
        self.budgets = Budgets.of(config)  # from kvfuzz's configuration, never the scheduler's own reading of it
        self.queues = queues_for(setup.policy)
        self.view = VllmView(scheduler, setup, pausing)
        self.known_tokens = known_tokens
        self.pausing = pausing  # the client's pause: its own check, and what the others exempt

    def added(self, arrival: Arrival) -> None:
        self.queues.added(arrival)

    def stepped(self, events: StepEvents) -> None:
        """Check one step: the client's pause, its victims, then its admissions and what it left unserved, then its
        budgets. With resumable requests (``sessions``) only the step's own budgets: the queues the order and liveness
        checks rebuild have no place for a session paused at its stop (it holds a running slot outside vLLM's running
        queue) nor for one resumed (it returns through vLLM's queue of requests holding blocks), so those checks, and
        the running cap read from the rebuilt queue, are left out there (docs/scheduler-features.md)."""
        check_unsplit(self.budgets, events, self.known_tokens)
        if self.setup.sessions:
            check_budgets(self.budgets, events, ())
            return
        queues, view = self.queues, self.view
        view.observe(events.admitted)
        self.pausing.check(events.step, dict(events.scheduled), events.admitted, view.served_ahead)
        check_victims(queues, events)
        queues.before_admissions(events)
        check_admissions(queues, events, Holds(queues, events, view, self.setup.max_loras))
        room = room_left(self.budgets, events, view)
        check_running_served(self.budgets, queues, events, view, room, self.known_tokens)
        if self.setup.model == FULL_ATTENTION and self.setup.kv_connector == "none":
            holds = Holds(queues, events, view, self.setup.max_loras)
            check_head_admitted(
                self.budgets,
                queues,
                events,
                view,
                room,
                holds,
                self.known_tokens,
                self.setup.block_size,
                self.setup.speculative_tokens,
            )
        queues.admit(events, frozenset(view.served_ahead))
        check_budgets(self.budgets, events, queues.running)
