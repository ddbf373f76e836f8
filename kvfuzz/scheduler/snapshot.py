"""What a scheduler target's engine holds after each ``schedule()``, engine-neutral: each request's state, the
tokens scheduled for it in the step, and the blocks the engine's own KV-cache manager holds for it. A session tells
its :class:`StepObserver` of each step; the observer asks the session for a :class:`StepSnapshot` only if it wants
one (``kvfuzz show`` draws them as a timeline), so a search pays one no-op call per step."""

from __future__ import annotations

from typing import Mapping, Protocol

import attrs

REQUEST_STATES = {
    "waiting": "added, not yet scheduled (or waiting again after a failed admission)",
    "loading": "waiting while a KV connector loads its prefix",
    "running": "scheduled in this step",
    "idle": "running, but given no tokens in this step",
    "preempted": "preempted: its blocks released, to be scheduled again from its computed prefix",
    "finished": "finished (its last token sampled, or a stop)",
    "aborted": "aborted by the client",
}
"""Every state a request's lane can be in, and what it means (the page's and the picture's legend)."""


@attrs.frozen
class RequestAtStep:
    """One request after one step's scheduling. ``blocks`` are the physical blocks the engine's own manager holds
    for it, every KV-cache group's in order (vLLM's null block left out); ``state`` is a key of
    :data:`REQUEST_STATES`; ``status`` the engine's own word for it."""

    state: str  # a key of REQUEST_STATES
    status: str  # the engine's own status (vLLM's RequestStatus name, SGLang's queue)
    scheduled: int = 0  # tokens scheduled for it in this step
    computed: int = 0  # tokens the engine counts as computed, this step's scheduled ones included
    blocks: tuple[int, ...] = ()  # blocks its engine holds for it

    def __attrs_post_init__(self) -> None:
        if self.state not in REQUEST_STATES:
            raise ValueError(f"unknown request state {self.state!r}")


@attrs.frozen
class StepSnapshot:
    """Every request the client added so far, after step ``step``'s scheduling, in arrival order."""

    step: int  # the schedule() call, counted from 1
    requests: Mapping[str, RequestAtStep]  # request id -> its state


class SnapshotSource(Protocol):
    """A session that can describe its engine after a step."""

    def snapshot(self, scheduled: Mapping[str, int]) -> StepSnapshot: ...


class StepObserver(Protocol):
    """Told of every step, right after the engine scheduled it and before kvfuzz's checks of that step run."""

    def stepped(self, session: SnapshotSource, scheduled: Mapping[str, int]) -> None: ...


class NoObserver:
    """The observer of a search: nothing is recorded."""

    def stepped(self, session: SnapshotSource, scheduled: Mapping[str, int]) -> None:
        pass


NO_OBSERVER = NoObserver()
