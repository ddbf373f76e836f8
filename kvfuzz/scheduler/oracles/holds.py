"""Why the scheduler may pass over a waiting request without breaking its policy: the LoRA limit (decided here,
from the events), or a reason outside the policy that only the engine's own state shows
(:class:`~kvfuzz.scheduler.oracles.engine.VllmView`). The order and liveness checks share it: a request passed over
for no such reason was passed over by the policy."""

from __future__ import annotations

from typing import Optional

from kvfuzz.scheduler.lora import lora_name
from kvfuzz.scheduler.oracles.engine import VllmView
from kvfuzz.scheduler.oracles.events import StepEvents
from kvfuzz.scheduler.oracles.queues import Queues


class Holds:
    """The reasons of one step, walked in waiting order. Invariant: ``adapters`` holds the LoRA adapters of the
    requests running at the waiting loop's start (after the running loop) and of those admitted before the request
    asked about, as vLLM's ``scheduled_loras`` does."""

    def __init__(self, queues: Queues, events: StepEvents, view: VllmView, max_loras: int) -> None:
        self.queues = queues
        self.view = view
        self.max_loras = max_loras
        first = [*queues.running, *view.served_ahead]  # running, and admitted from the connector's queue first
        self.adapters = {queues.arrivals[request].lora for request in first} - {0}
        self.events = events

    def reason(self, request: str) -> Optional[str]:
        """Why ``request`` (the next in waiting order) may be passed over; None where nothing but the policy may."""
        lora = self.queues.arrivals[request].lora
        if self.max_loras and lora and lora not in self.adapters and len(self.adapters) >= self.max_loras:
            return (
                f"its adapter {lora_name(lora)} is not among the {self.max_loras} the running requests use "
                f"({', '.join(map(lora_name, sorted(self.adapters)))}), and max_loras is {self.max_loras}"
            )
        return self.view.held_back(request)

    def admitted(self, request: str) -> None:
        """``request`` was admitted: its adapter is in use from now on."""
        lora = self.queues.arrivals[request].lora
        if lora:
            self.adapters.add(lora)
