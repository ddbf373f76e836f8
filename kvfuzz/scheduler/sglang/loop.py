"""SGLang's scheduling loop for the KV cache, without the ``Scheduler`` object (which cannot be built without a
model process: docs/sglang.md): one example's waiting queue, running batch and chunked request, stepped as
``Scheduler.get_next_batch_to_run`` and ``process_batch_result`` step them under synchronous scheduling (no overlap,
no speculative decoding, no mixed chunks, no priority, no disaggregation, no hierarchical cache), calling SGLang's
own ``SchedulePolicy.calc_priority``, ``PrefillAdder.add_chunked_req`` / ``add_one_req``, ``ScheduleBatch.init_new``
/ ``prepare_for_extend`` / ``filter_batch`` / ``merge_batch`` / ``check_decode_mem`` / ``retract_decode`` /
``prepare_for_decode``, ``Req.init_next_round_input`` / ``update_finish_state`` and ``checkpoint_kv_cache`` /
``release_kv_cache`` over the radix cache. What the loop itself does is the glue between those calls, as the
scheduler's methods do it (each step below names the method it follows).

Invariant: every request the loop was given is in exactly one of ``waiting_queue``, the running batch, the chunked
request, or ``finished`` (reported once, with its KV released)."""

from __future__ import annotations

from array import array
from typing import Any, Optional

import attrs

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.fake_model import EOS_TOKEN
from kvfuzz.scheduler.sglang.admission import SchedulerLimits, admit, sglang_rules
from kvfuzz.scheduler.sglang.build import ModelStandIn, new_pools, sglang

INIT_NEW_TOKEN_RATIO = 0.7
"""SGLang's ``SGLANG_INIT_NEW_TOKEN_RATIO`` default: times ``schedule_conservativeness`` (at most 1), the share of
its remaining output the PrefillAdder reserves for each running request that does not ignore EOS."""

MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
"""The floor the ratio decays to, as a share of its start (``SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR`` default)."""

NEW_TOKEN_RATIO_DECAY_STEPS = 600
"""Decode steps the ratio takes to decay from its start to its floor (``SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS``)."""


@attrs.frozen
class NewTokenRatio:
    """SGLang's ``NewTokenRatioTracker.from_config`` for a schedule conservativeness: the ratio's start, floor and
    decay per decode step. Invariant: ``floor <= start <= 1``."""

    start: float
    floor: float
    decay: float

    @classmethod
    def of(cls, schedule_conservativeness: float) -> "NewTokenRatio":
        start = min(INIT_NEW_TOKEN_RATIO * schedule_conservativeness, 1.0)
        floor = min(start * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        return cls(start, floor, (start - floor) / NEW_TOKEN_RATIO_DECAY_STEPS)


class SchedulerLoop:
    """The scheduler's KV-cache state of one example, and its step."""

    rewrites = 0  # released pages written while a batch reading them is in flight: none, no batch is ever in flight

    def __init__(self, setup: SchedulerSetup) -> None:
        api = sglang()
        self.setup = setup
        with api.engine.use_context(api.engine.context):
            self.pools = new_pools(setup)
        self.model_config = ModelStandIn()
        self.waiting_queue: list[Any] = []  # Reqs waiting for a prefill, in arrival (or retraction) order
        self.running_batch: Any = api.ScheduleBatch(reqs=[], batch_is_full=False)  # the decoding requests
        self.chunked_req: Optional[Any] = None  # the request whose prompt is being prefilled in chunks
        self.last_batch: Optional[Any] = None  # the batch the previous step ran
        self.ratio = NewTokenRatio.of(setup.schedule_conservativeness)
        self.new_token_ratio = self.ratio.start
        self.finished: dict[str, Any] = {}  # finished or aborted request -> its Req
        self.requests: dict[str, Any] = {}  # every request -> its Req
        self.retractions = 0  # requests retract_decode retracted
        # request -> why the last admission loop that reached it stopped there: the PrefillAdder's verdict on it
        # (NO_TOKEN, OTHER), or the batch found full before it was asked (read by stuck.py when a drain step stalls)
        self.refusals: dict[str, str] = {}

    def has_requests(self) -> bool:
        return bool(self.waiting_queue or self.running_batch.reqs or self.chunked_req is not None) or (
            self.last_batch is not None and any(not req.finished() for req in self.last_batch.reqs)
        )

    def add_request(self, rid: str, prompt: list[int], max_tokens: int, eos: bool = False) -> int:
        """``handle_generate_request``: a ``Req`` with no stop but its length and, with ``eos``, the model's EOS token
        (as the tokenizer manager passes the tokenizer's in ``eos_token_ids``; without, it ignores EOS), its
        ``max_new_tokens`` clipped and its prompt validated by SGLang's own ``init_req_max_new_tokens`` and
        ``validate_input_length`` (:mod:`kvfuzz.scheduler.sglang.admission`; ``max_req_len`` the worker's
        ``min(context_len, capacity) - 1``, ``max_req_input_len`` five less), and appended to the waiting queue.
        Returns its clipped ``max_new_tokens`` (the most it will output), or -1 where SGLang refuses it (finished,
        aborted, never queued: SGLang queues it to abort it at its first prefill, which kvfuzz does not drive)."""
        api = sglang()
        params = api.engine.SamplingParams(max_new_tokens=max_tokens, ignore_eos=not eos)
        params.normalize(None)  # as the tokenizer manager does (no stop strings)
        req = api.Req(rid, "", array("q", prompt), params, eos_token_ids={EOS_TOKEN})
        self.requests[rid] = req
        capacity = self.setup.num_blocks * self.setup.block_size  # max_total_num_tokens
        max_req_len = min(self.setup.max_model_len + 1, capacity) - 1  # the worker's min(context_len, capacity) - 1
        limits = SchedulerLimits(
            max_new_tokens_limit=sglang_rules().max_new_tokens_limit,
            max_req_len=max_req_len,
            max_total_num_tokens=capacity,
            page_size=self.setup.block_size,
            token_to_kv_pool_allocator=self.pools.token_pool,
            chunked_prefill_size=self.setup.max_num_batched_tokens,
        )
        if admit(req, limits, max_req_len - 5) is not None:
            req.finished_reason = api.FINISH_ABORT()
            self.finished[rid] = req
            return -1
        self.waiting_queue.append(req)
        return int(params.max_new_tokens)

    def abort(self, rid: str) -> None:
        """``abort_request``: a waiting request is dropped at once; a running or chunked one is marked
        ``to_finish`` and finishes when its next result is processed (its KV released then, unchecked)."""
        api = sglang()
        req = self.requests[rid]
        if req.finished():
            return
        if req in self.waiting_queue:
            self.waiting_queue.remove(req)
            req.finished_reason = api.FINISH_ABORT()
            if req.kv.holds_kv:
                api.engine.release_kv_cache(req, self.pools.tree_cache, checkpoint=False)
            self.finished[rid] = req
        else:
            req.to_finish = api.FINISH_ABORT()

    # -- get_next_batch_to_run ---------------------------------------------------------------------------------

    def next_batch(self) -> Optional[Any]:
        """``get_next_batch_to_run``: the last prefill merged into the running batch (its chunked request stashed
        into the tree), then a new prefill batch if the PrefillAdder admits any, else the running batch's decode."""
        api = sglang()
        with api.engine.use_context(api.engine.context):
            excluded = []
            if self.chunked_req is not None:
                excluded.append(self.chunked_req)
                if self.chunked_req.extend_end > self.chunked_req.prefix_len:
                    api.engine.checkpoint_kv_cache(self.chunked_req, self.pools.tree_cache)
            last = self.last_batch
            if last is not None and last.forward_mode.is_extend():
                if last.chunked_req is not None:
                    excluded.append(last.chunked_req)
                size = last.batch_size()
                last.filter_batch(reqs_to_exclude=excluded)
                if last.batch_size() < size:
                    self.running_batch.batch_is_full = False
                if not last.is_empty() and last is not self.running_batch:
                    if self.running_batch.is_empty():
                        self.running_batch = last
                    else:
                        self.running_batch.merge_batch(last)
            size = self.running_batch.batch_size()
            self.running_batch.filter_batch()
            if self.running_batch.batch_size() < size:
                self.running_batch.batch_is_full = False
            batch = self._new_prefill_batch()
            if batch is None and not self.running_batch.is_empty():
                batch = self._update_running_batch(self.running_batch)
                batch = None if batch is None or batch.is_empty() else batch
            self.last_batch = batch
            return batch

    def _new_prefill_batch(self) -> Optional[Any]:
        """``_get_new_batch_prefill_raw``."""
        api = sglang()
        pools, running = self.pools, self.running_batch
        if running.is_empty():
            running.batch_is_full = False
        if (running.batch_is_full or not self.waiting_queue) and self.chunked_req is None:
            self._refuse_head("the batch full before it")
            return None
        running_bs = len(running.reqs)
        if self._allocatable(running_bs, 0) <= 0 and self.chunked_req is None:
            running.batch_is_full = True
            self._refuse_head("no request row free before it")
            return None
        pools.policy.calc_priority(self.waiting_queue, running)
        adder = api.PrefillAdder(
            self.setup.block_size,
            pools.tree_cache,
            pools.token_pool,
            running,
            self.new_token_ratio,
            self.setup.max_num_batched_tokens,  # max_prefill_tokens
            self.setup.max_num_batched_tokens,  # chunked_prefill_size
            0,
            max_running_requests=self.setup.max_num_seqs,
            waiting_queue_len=len(self.waiting_queue),
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            adder.chunked_req_limit = pools.policy.shortest_prefill_chunk_limit(
                self.chunked_req, self.waiting_queue, adder.rem_chunk_tokens or 0, self.setup.block_size
            )
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in self.waiting_queue:
            if adder.budget_state() == api.AddReqResult.OTHER:
                self.refusals[req.rid] = "the step's budget spent before it"
                break
            held = sum(r.kv.holds_kv for r in adder.can_run_list)
            if len(adder.can_run_list) >= self._allocatable(len(running.reqs), held):
                running.batch_is_full = True
            if running.batch_is_full:
                self.refusals[req.rid] = "the batch full before it"
                break
            req.init_next_round_input(pools.tree_cache)
            result = adder.add_one_req(req, has_chunked_req=self.chunked_req is not None, truncation_align_size=None)
            if result != api.AddReqResult.CONTINUE:
                self.refusals[req.rid] = f"PrefillAdder's verdict {result.name}"
                if result == api.AddReqResult.NO_TOKEN:
                    running.batch_is_full = len(adder.can_run_list) > 0 or not running.is_empty()
                break
        can_run = adder.can_run_list
        if not can_run:
            return None
        chosen = set(can_run)
        self.waiting_queue = [req for req in self.waiting_queue if req not in chosen]
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        batch = api.ScheduleBatch.init_new(
            can_run,
            pools.req_to_token_pool,
            pools.token_pool,
            pools.tree_cache,
            self.model_config,
            False,
            api.no_speculation,
            chunked_req=self.chunked_req,
        )
        batch.prepare_for_extend()
        batch.decoding_reqs = None
        return batch

    def _refuse_head(self, why: str) -> None:
        """The admission loop stopped before asking the waiting queue's head: ``why``."""
        if self.waiting_queue:
            self.refusals[self.waiting_queue[0].rid] = why

    def _allocatable(self, running_bs: int, held_rows: int) -> int:
        """``get_num_allocatable_reqs``: the free ``req_to_token`` rows (and those the counted requests hold), capped
        by the running-request limit."""
        rows = self.pools.req_to_token_pool.available_size() + held_rows
        return min(self.setup.max_num_seqs - running_bs, rows)

    def _update_running_batch(self, batch: Any) -> Optional[Any]:
        """``update_running_batch``: retract under memory pressure, then ``prepare_for_decode``."""
        initial = batch.batch_size()
        batch.filter_batch()
        if batch.is_empty():
            batch.batch_is_full = False
            return batch
        if not batch.check_decode_mem():
            retracted, self.new_token_ratio, aborted = batch.retract_decode()
            self.retractions += len(retracted)
            for req in aborted:
                self.finished[req.rid] = req
            self.waiting_queue.extend(retracted)
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.ratio.decay, self.ratio.floor)
        if batch.batch_size() < initial:
            batch.batch_is_full = False
        if batch.is_empty():
            return batch
        batch.prepare_for_decode()
        return batch

    # -- process_batch_result ------------------------------------------------------------------------------------

    def process(self, batch: Any, next_token_ids: list[int]) -> None:
        """``process_batch_result_prefill`` / ``_decode`` for a synchronous batch: each request's sampled token
        appended (none for a chunk that is not the prompt's last), its finish state updated, a finished request's KV
        released into the tree and a prefilled one's checkpointed."""
        api = sglang()
        tree = self.pools.tree_cache
        with api.engine.use_context(api.engine.context):
            if batch.forward_mode.is_extend():
                for req, token in zip(batch.reqs, next_token_ids):
                    if req.is_retracted:
                        continue
                    if req.inflight_middle_chunks > 0:
                        req.inflight_middle_chunks -= 1
                        continue
                    if req.finished():
                        continue
                    req.output_ids.append(token)
                    req.update_finish_state()
                    if req.finished():
                        api.engine.release_kv_cache(req, tree, checkpoint=True)
                        self.finished[req.rid] = req
                    else:
                        api.engine.checkpoint_kv_cache(req, tree)
            else:
                for req, token in zip(batch.reqs, next_token_ids):
                    if req.finished() or req.is_retracted:
                        continue
                    req.output_ids.append(token)
                    req.update_finish_state(1)
                    if req.finished():
                        api.engine.release_kv_cache(req, tree, checkpoint=True)
                        self.finished[req.rid] = req
