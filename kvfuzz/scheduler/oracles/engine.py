"""What the policy oracles read of vLLM's scheduler itself, each read named and justified here, and nothing else:

* the pool's free block count after the step (the accounting check holds it to the worker's tables every step);
* the watermark and lookahead the configuration gives the manager and the scheduler (configuration, not state);
* a running request's computed tokens, against the tokens its client and its outputs gave it: one with none left to
  compute waits for an output, not for the scheduler;
* a request's own state where vLLM passes it over for a reason that is not the policy's: output of a preempted
  request still in flight under async scheduling (``num_stale_output_tokens``, deliverable), a KV connector's
  transfer (a request the connector holds: loading, holding blocks in ``kv_holding_waiting``, or deferred by the
  connector), or a running request whose last output is already in flight (async scheduling's
  ``num_output_placeholders`` reaching ``max_tokens``), that stands at ``max_model_len``, or whose prefill chunk a
  Mamba group's align mode must cut at a block boundary the budget left may not reach; and under a prefill cadence
  (``prefill_schedule_interval`` above 1) a running request with prefill left and every waiting request: on the
  steps between prefill steps, while a decode runs, vLLM holds prefill chunks and stops admitting at the first
  prefill it defers; and while the client has paused the scheduler (:mod:`kvfuzz.scheduler.pausing`, the client's
  own record), every waiting request, and with ``keep`` every running one;
* whether vLLM defers block frees (``defer_block_free``: a KV consumer under async scheduling) and a running request
  has a step in flight (``last_sched_seq`` past ``processed_step_seq``): a short pool then stops the running
  requests' service rather than preempt a request whose blocks would only be freed later.

A connector-held request stays exempt from the order checks until it is admitted: once held, the engine serves it
from its own queue (``kv_holding_waiting``, drained before ``waiting``)."""

from __future__ import annotations

from typing import Any, Optional

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.pausing import Paused, Pausing


class VllmView:
    """The reads of one example's ``Scheduler`` the oracles make."""

    def __init__(self, scheduler: Any, setup: SchedulerSetup, pausing: Pausing) -> None:
        self.scheduler = scheduler
        self.pausing = pausing  # the client's pause (set by the client, not read from vLLM)
        self.connector = setup.kv_connector != "none"
        self.async_scheduling = setup.async_scheduling
        self.watermark = int(getattr(scheduler.kv_cache_manager, "watermark_blocks", 0))  # kept free for admissions
        self.lookahead = int(getattr(scheduler, "num_lookahead_tokens", 0))  # slots allocated past the tokens
        self.max_model_len = setup.max_model_len
        self.connector_held: set[str] = set()  # requests a KV connector held since they last ran
        self.served_ahead: set[str] = set()  # admitted by the last step from the connector's queue, ahead of waiting
        self.holding_blocks: set[str] = set()  # waiting with blocks at the last step (its load in flight or done)
        self.aligned_chunks = bool(getattr(scheduler, "need_mamba_block_aligned_split", False))  # Mamba's align mode
        self.prefill_interval = setup.prefill_schedule_interval  # prefill every this many executed steps (cadence)

    def free_blocks(self) -> int:
        """The pool's free blocks now (evictable cached ones included, as vLLM's admission counts them)."""
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def observe(self, admitted: frozenset[str]) -> None:
        """Right after a step's ``schedule()``, before the checks: the requests the step admitted that a KV connector
        held before it (``served_ahead``: vLLM serves those from its own queue first), and the requests a connector
        holds now."""
        # served ahead: admitted from the queue of requests waiting with blocks; a request a connector deferred with
        # none (``deferred_waiting`` alone: skipped, for the LoRA limit say) is served from the waiting queue, in order
        self.served_ahead = self.holding_blocks & admitted
        self.connector_held -= admitted
        if not self.connector:
            return
        scheduler = self.scheduler
        holding = {request.request_id for request in getattr(scheduler, "kv_holding_waiting", ())}
        holding |= {
            request_id
            for request_id, request in scheduler.requests.items()
            if request.status.name == "WAITING_FOR_REMOTE_KVS"
        }
        self.holding_blocks = holding
        held = holding | {request.request_id for request in getattr(scheduler, "deferred_waiting", ())}
        self.connector_held |= held - admitted

    def held_back(self, request_id: str) -> Optional[str]:
        """Why vLLM may pass over waiting request ``request_id`` for a reason outside the policy (None: no reason)."""
        if self.pausing.state is not Paused.UNPAUSED:
            return f"the client paused the scheduler ({self.pausing.state.value})"
        if request_id in self.connector_held:
            return "the KV connector holds it (a transfer of its KV, or its blocks loaded ahead of the queue)"
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        if getattr(request, "num_stale_output_tokens", 0) and not getattr(request, "drop_stale_output", True):
            return "output from before its preemption is still in flight (async scheduling)"
        if self.prefill_interval > 1:  # vLLM stops admitting at the first prefill the cadence defers
            return (
                f"the prefill cadence (prefill_schedule_interval {self.prefill_interval}) may stop this step's "
                "admissions at a prefill ahead of it or at its own"
            )
        return None

    def computed(self, request_id: str) -> int:
        """The tokens vLLM counts as computed for ``request_id`` (0 for a request it does not know)."""
        request = self.scheduler.requests.get(request_id)
        return 0 if request is None else int(request.num_computed_tokens)

    def running_exempt(self, request_id: str) -> Optional[str]:
        """Why vLLM may leave running request ``request_id`` unscheduled with budget to spare (None: no reason)."""
        if self.pausing.state is Paused.PAUSED_ALL:
            return "the client paused the scheduler (PAUSED_ALL): nothing is scheduled"
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        placeholders = int(getattr(request, "num_output_placeholders", 0))
        if placeholders > 0 and (
            request.num_computed_tokens + 2 - placeholders >= request.num_prompt_tokens + request.max_tokens
        ):
            return "its last output is already in flight (async scheduling)"
        if request.num_computed_tokens + 1 >= self.max_model_len:
            return "it stands at max_model_len"
        if self.prefill_interval > 1 and getattr(request, "is_prefill_chunk", False):
            interval = self.prefill_interval
            return f"its prefill chunk waits for the prefill cadence (prefill_schedule_interval {interval})"
        if self.aligned_chunks and request.num_computed_tokens < request.num_tokens - 1:
            return "its prefill chunk must be block-aligned (a Mamba group), and the budget left may hold no block"
        if self.connector and self.scheduler.connector.has_pending_block_frees():
            return "the KV connector has block frees pending"
        if self._deferred_victim():
            return "vLLM defers block frees, and preempting a request with a step in flight would free nothing now"
        return None

    def _deferred_victim(self) -> bool:
        """Whether vLLM defers block frees (a KV consumer under async scheduling) and a running request has a step
        in flight: where the pool is short, ``schedule()`` then stops serving running requests rather than preempt
        one whose blocks would only be freed later."""
        scheduler = self.scheduler
        if not getattr(scheduler, "defer_block_free", False):
            return False
        return any(request.last_sched_seq > scheduler.processed_step_seq for request in scheduler.running)
