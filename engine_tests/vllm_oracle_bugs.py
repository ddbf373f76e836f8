"""Bugs seeded into vLLM's v1 scheduler at runtime (the installed package is never edited) that break what the
scheduler promises beyond KV-cache safety: its policy's order, its budgets, its liveness (docs/oracles.md). Each
function takes a ``pytest.MonkeyPatch`` and patches the scheduler until the monkeypatch is undone; none of them
breaks a KV-cache invariant, so only the policy oracles can catch them."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from engine_tests.vllm_history import _schedule_without


def fcfs_victim_requeued_at_the_back(patch: pytest.MonkeyPatch) -> None:
    """A preempted request goes to the back of the FCFS waiting queue instead of its front: requests that arrived
    after it are admitted before it resumes."""
    original = Scheduler._preempt_request

    def preempt(self: Scheduler, request: Request, *args: Any, **kwargs: Any) -> None:
        original(self, request, *args, **kwargs)
        self.waiting.remove_request(request)
        self.waiting.add_request(request)

    patch.setattr(Scheduler, "_preempt_request", preempt)


_PRIORITY_VICTIM = """\
preempted_req = max(
    self.running,
    key=lambda r: (r.priority, r.arrival_time),
)
"""


def priority_victim_is_the_last_admitted(patch: pytest.MonkeyPatch) -> None:
    """Under the priority policy the victim of a preemption is the running request admitted last (FCFS's victim),
    whatever its priority."""
    _schedule_without(patch, _PRIORITY_VICTIM, "preempted_req = self.running[-1]\n")


def waiting_heap_by_arrival_alone(patch: pytest.MonkeyPatch) -> None:
    """The priority policy's waiting heap orders requests by arrival alone: a request of higher priority that arrived
    later waits behind one of lower priority."""

    def less(self: Request, other: Request) -> bool:
        return bool((self.arrival_time, self.request_id) < (other.arrival_time, other.request_id))

    patch.setattr(Request, "__lt__", less)


def budget_one_block_larger(patch: pytest.MonkeyPatch) -> None:
    """The scheduler reads its token budget one block larger than configured (``max_num_batched_tokens`` and the
    scheduled-token cap both), so a step may schedule more tokens than the model runner was sized for."""
    original = Scheduler.__init__

    def init(self: Scheduler, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        extra = self.block_size
        self.max_num_scheduled_tokens += extra
        self.scheduler_config = copy.copy(self.scheduler_config)  # kvfuzz's configuration is left as it was
        object.__setattr__(
            self.scheduler_config, "max_num_batched_tokens", self.scheduler_config.max_num_batched_tokens + extra
        )

    patch.setattr(Scheduler, "__init__", init)


def chunked_prefill_read_as_on(patch: pytest.MonkeyPatch) -> None:
    """The scheduler reads ``enable_chunked_prefill`` as on although it is off: a waiting request whose prompt does
    not fit the step's token budget left is admitted with a first chunk of it."""
    original = Scheduler.__init__

    def init(self: Scheduler, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.scheduler_config = copy.copy(self.scheduler_config)  # kvfuzz's configuration is left as it was
        object.__setattr__(self.scheduler_config, "enable_chunked_prefill", True)

    patch.setattr(Scheduler, "__init__", init)


def running_cap_one_more(patch: pytest.MonkeyPatch) -> None:
    """The scheduler's running-request cap is one more than ``max_num_seqs`` (its own assertion reads the same
    wrong cap, so it does not fire)."""
    original = Scheduler.__init__

    def init(self: Scheduler, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.max_num_running_reqs += 1
        self.max_num_active_reqs += 1

    patch.setattr(Scheduler, "__init__", init)


def long_prefill_cap_doubled(patch: pytest.MonkeyPatch) -> None:
    """The scheduler reads ``long_prefill_token_threshold`` twice as large as configured: a long prefill takes twice
    its share of a step beside other requests."""
    original = Scheduler.__init__

    def init(self: Scheduler, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.scheduler_config = copy.copy(self.scheduler_config)  # kvfuzz's configuration is left as it was
        threshold = self.scheduler_config.long_prefill_token_threshold
        object.__setattr__(self.scheduler_config, "long_prefill_token_threshold", 2 * threshold)

    patch.setattr(Scheduler, "__init__", init)


def adaptive_floor_by_running_alone(patch: pytest.MonkeyPatch) -> None:
    """``long_prefill_token_threshold_adaptive`` floors the cap at the budget's share of the running requests alone,
    not of every request in the engine: with few running and many waiting, a long prefill takes most of a step."""
    _schedule_without(
        patch,
        "long_prefill_token_threshold, input_budget // num_eligible_reqs\n",
        "long_prefill_token_threshold, input_budget // max(1, num_running)\n",
    )


def active_cap_one_more(patch: pytest.MonkeyPatch) -> None:
    """The scheduler admits one request more than ``max_num_active_seqs`` into RUNNING (within ``max_num_seqs``, so
    its own assertion does not fire)."""
    original = Scheduler.__init__

    def init(self: Scheduler, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.max_num_active_reqs += 1

    patch.setattr(Scheduler, "__init__", init)


def pause_ignored(patch: pytest.MonkeyPatch) -> None:
    """The scheduler drops the engine core's pause: ``set_pause_state`` changes nothing, so new requests start (and,
    paused to keep, anything is scheduled) while the trainer updates the weights."""
    patch.setattr(Scheduler, "set_pause_state", lambda self, pause_state: None)


def paused_new_admits_waiting(patch: pytest.MonkeyPatch) -> None:
    """Under ``PAUSED_NEW`` the waiting loop serves the waiting queue as if unpaused (the check for the unpaused state
    widened to every state but ``PAUSED_ALL``): new requests start while paused."""
    _schedule_without(
        patch,
        "if not request_queue and self._pause_state == PauseState.UNPAUSED:\n",
        "if not request_queue and self._pause_state != PauseState.PAUSED_ALL:\n",
    )


def model_length_one_block_longer(patch: pytest.MonkeyPatch) -> None:
    """The scheduler takes ``max_model_len`` one block longer than the model's: it neither caps a step's tokens nor
    stops a request at the model's length."""
    original = Scheduler.__init__

    def init(self: Scheduler, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.max_model_len += self.block_size

    patch.setattr(Scheduler, "__init__", init)


def resumed_request_held_from_decoding(patch: pytest.MonkeyPatch) -> None:
    """A preemption sets the request's decode gate (``next_decode_eligible_step``, pipeline parallelism's cadence)
    four steps ahead, so once resumed the request sits in the running queue unscheduled for a few steps while the
    budget has room."""
    original = Scheduler._preempt_request

    def preempt(self: Scheduler, request: Request, *args: Any, **kwargs: Any) -> None:
        original(self, request, *args, **kwargs)
        request.next_decode_eligible_step = self.current_step + 4

    patch.setattr(Scheduler, "_preempt_request", preempt)


def admission_only_when_idle(patch: pytest.MonkeyPatch) -> None:
    """The admission cap is compared with the wrong count: while any request runs, the waiting loop sees the running
    queue as full, so waiting requests are admitted only when nothing runs."""
    original = Scheduler.schedule

    def schedule(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
        saved = self.max_num_active_reqs
        if self.running:
            self.max_num_active_reqs = len(self.running)
        try:
            return original(self, *args, **kwargs)
        finally:
            self.max_num_active_reqs = saved

    patch.setattr(Scheduler, "schedule", schedule)


def fcfs_victim_admitted_early(patch: pytest.MonkeyPatch) -> None:
    """Under FCFS the victim of a preemption is the running request right after the one that needs blocks (the
    earliest admitted of those the step has not visited yet), not the one admitted last."""
    _schedule_without(
        patch,
        "preempted_req = self.running.pop()\n",
        "preempted_req = self.running.pop(req_index + 1 if req_index + 1 < len(self.running) else -1)\n",
    )
