"""The client's pauses (``SchedulerSetup.pauses``): vLLM's ``Scheduler.set_pause_state``, as the engine core's
``pause_scheduler`` sets it while an RLHF trainer updates the weights, and ``resume_scheduler`` clears it; and what a
paused scheduler promises (``Check.PAUSE``).

* ``pause()`` (the engine core's ``"wait"`` mode, ``PAUSED_NEW``): no new request starts. The requests running go on,
  and so may a request that waits holding KV blocks (a KV connector's load, served from vLLM's own queue of such
  requests); every other waiting request, new or preempted, waits until ``unpause()``.
* ``pause(keep=True)`` (``"keep"``, ``PAUSED_ALL``): nothing is scheduled at all. The engine core does not step a
  scheduler paused so (it reports no unfinished request), so a step comes only while batches or transfers are in
  flight.
* ``unpause()``: back to normal; the drain unpauses first, so every request still finishes.

The checks read the pause the client set (this module's state), never vLLM's own ``pause_state``, so a scheduler that
drops a pause is caught. The policy oracles hold no request to the order and liveness promises while paused
(:class:`~kvfuzz.scheduler.oracles.engine.VllmView`)."""

from __future__ import annotations

import enum
from typing import Any, Collection

from kvfuzz.scheduler.violations import Check, SchedulerViolation


class Paused(enum.Enum):
    """The client's pause, as vLLM's ``PauseState`` names it."""

    UNPAUSED = "UNPAUSED"
    PAUSED_NEW = "PAUSED_NEW"  # no new request starts; running requests and those holding KV blocks go on
    PAUSED_ALL = "PAUSED_ALL"  # nothing is scheduled


class Pausing:
    """The pause the client has set now, and how many steps ran paused (a search's report)."""

    def __init__(self) -> None:
        self.state = Paused.UNPAUSED  # what the client asked for last
        self.paused_steps = 0  # steps scheduled while paused

    def pause(self, scheduler: Any, keep: bool) -> None:
        """Pause ``scheduler`` (``keep``: nothing scheduled; else no new request started)."""
        self.state = Paused.PAUSED_ALL if keep else Paused.PAUSED_NEW
        self._tell(scheduler)

    def unpause(self, scheduler: Any) -> None:
        self.state = Paused.UNPAUSED
        self._tell(scheduler)

    def _tell(self, scheduler: Any) -> None:
        from vllm.v1.core.sched.interface import PauseState  # the engine's own enum, on first use

        scheduler.set_pause_state(PauseState[self.state.value])

    def check(
        self, step: int, scheduled: dict[str, int], admitted: Collection[str], served_ahead: Collection[str]
    ) -> None:
        """Hold a step scheduled under the client's pause to it (``admitted``: the requests the step admitted;
        ``served_ahead``: those of them that waited holding KV blocks, which ``PAUSED_NEW`` still serves)."""
        if self.state is Paused.UNPAUSED:
            return
        self.paused_steps += 1
        if self.state is Paused.PAUSED_ALL and scheduled:
            listed = ", ".join(f"{request}: {count}" for request, count in scheduled.items())
            raise SchedulerViolation(
                Check.PAUSE,
                step,
                next(iter(scheduled)),
                f"the client paused the scheduler (PAUSED_ALL, the engine core's 'keep' mode), but the step "
                f"schedules {sum(scheduled.values())} tokens ({listed}): a scheduler paused so schedules nothing",
                "a step scheduled while paused (keep)",
            )
        started = sorted(set(admitted) - set(served_ahead))
        if started:
            raise SchedulerViolation(
                Check.PAUSE,
                step,
                started[0],
                f"the client paused new requests (PAUSED_NEW, the engine core's 'wait' mode), but the step admits "
                f"{', '.join(started)} from the waiting queue: only the running requests, and those waiting with KV "
                "blocks already loaded, go on until the client unpauses",
                "a request started while paused (new)",
            )
