"""What a hang of the progress check is: the request vLLM's scheduler is stuck on, and why, in words that do not
depend on the example, so that a campaign keys two livelocks apart and the same livelock met twice together.

The request stuck is the one the scheduler would take first: a running one if any is left unfinished (it should
be scheduled every step), else the head of the waiting queues (vLLM's ``kv_holding_waiting``, then ``waiting``;
every other request waits behind it). What it is stuck as is its state (a preempted request never resumed, a
waiting request never admitted, a request whose KV load never finishes, a running request never scheduled); why
is what the configuration brings to the admission (speculative drafts, the KV connector, partial prefix-cache hits,
or none of them) and whether the idle pool has room for the blocks the request still needs."""

from __future__ import annotations

from typing import Any, Optional

from kvfuzz.scheduler.config import SchedulerSetup

STATES = {
    "RUNNING": "a running request never scheduled",
    "PREEMPTED": "a preempted request never resumed",
    "WAITING": "a waiting request never admitted",
    "WAITING_FOR_REMOTE_KVS": "a request whose KV load never finishes",
}
"""What a stuck request is stuck as, by its ``RequestStatus`` name."""


def stuck_cause(base: str, scheduler: Any, setup: SchedulerSetup, unfinished: list[str]) -> str:
    """``base`` (``the drain ran past its bound``, ``a drain step scheduled nothing``) and what is stuck and why,
    for the progress check's cause (``unfinished``: the requests the client still waits for, in arrival order)."""
    request = _head(scheduler, set(unfinished))
    if request is None:
        return f"{base}: a request the scheduler no longer holds"
    what = STATES.get(request.status.name, f"a request left {request.status.name}")
    features = (
        "speculative drafts" if setup.speculative_tokens else "",
        "the KV connector" if setup.kv_connector != "none" else "",
        "partial prefix-cache hits" if setup.prefix_match_unit else "",
    )
    brought = " and ".join(feature for feature in features if feature) or "neither drafts nor a KV connector"
    return f"{base}: {what} (with {brought}; {_room(scheduler, setup, request)})"


def _head(scheduler: Any, unfinished: set[str]) -> Optional[Any]:
    """The unfinished request the scheduler would take first (None: it holds none of them)."""
    for request in scheduler.running:
        if request.request_id in unfinished:
            return request
    for name in ("kv_holding_waiting", "waiting"):
        queue = getattr(scheduler, name, None)
        if queue:
            for request in sorted(queue, key=lambda queued: _order(scheduler, queued)):
                if request.request_id in unfinished:
                    return request
    held = [scheduler.requests[request] for request in sorted(unfinished) if request in scheduler.requests]
    return held[0] if held else None


def _order(scheduler: Any, request: Any) -> tuple[int, float]:
    """The order vLLM's queue serves ``request`` in: by priority under the priority policy, else by arrival."""
    priority = request.priority if str(getattr(scheduler, "policy", "")).endswith("PRIORITY") else 0
    return priority, request.arrival_time


def _room(scheduler: Any, setup: SchedulerSetup, request: Any) -> str:
    """Whether the idle pool holds the blocks ``request`` still needs for its known tokens."""
    groups = scheduler.kv_cache_manager.coordinator.get_blocks(request.request_id)
    held = len(groups[0]) if groups else 0  # the first KV-cache group's: every group needs as many (full attention)
    needed = -(-request.num_tokens // setup.block_size) - held
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    return "the pool has room for it" if free >= needed else "the pool is short of its blocks"
