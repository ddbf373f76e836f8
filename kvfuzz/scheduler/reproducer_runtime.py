"""The fixed part of a vLLM scheduler reproducer (:mod:`kvfuzz.scheduler.reproducer`): Python source that imports
vLLM and the standard library only, copied verbatim into every reproducer after the trace's own constants.

It plays what kvfuzz plays around vLLM's ``Scheduler``, reduced to what decides scheduling: the model runner (the
tables and tokens it keeps from each ``SchedulerOutput``, the fake model's tokens, greedy verification of drafts, the
drafts proposed after a step), the worker side of the offloading connector (when each transfer job completes, as
kvfuzz's :class:`~kvfuzz.scheduler.offloading.OffloadingWorker` times it; no K/V is copied), and two of kvfuzz's
checks stated on vLLM's own objects: the block pool's accounting against the runner's tables after every
``schedule()`` (:mod:`kvfuzz.scheduler.accounting`), and progress (every request finishes within the drain's bound,
:func:`kvfuzz.scheduler.session.drain_bound`); on the R-SWA model, the positions the runner attends mapped to real
blocks (:meth:`~kvfuzz.scheduler.groups.GroupRule.attended`). kvfuzz's K/V content, output and speculative checks are
not here: they need kvfuzz's reference; a reproducer is generated only for a trace whose failure these checks see."""

from __future__ import annotations

RUNTIME = r'''
# ---- what kvfuzz plays around vLLM's Scheduler (the same in every reproducer) --------------------------------------
import dataclasses
import json
import os
import tempfile
import zlib

os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if MODEL_RUNNER == "V2" else "0"  # read when the config is built

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
import torch


class Failure(AssertionError):
    """What kvfuzz's check observed, stated on vLLM's objects."""


def build_scheduler():
    """vLLM's Scheduler offline: a config.json of the model in a temporary directory, a VllmConfig on the CPU, and
    NUM_BLOCKS + 1 blocks (block 0 is vLLM's null block): one full-attention KV-cache group for the full model; for
    a hybrid, the groups vLLM's own planner makes of its layers' specs, with the hybrid allocator a GPU engine has."""
    directory = tempfile.mkdtemp(prefix="vllm-reproducer-model-")
    with open(os.path.join(directory, "config.json"), "w") as stream:
        json.dump(HF_CONFIG, stream)
    model = ModelConfig(model=directory, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, dtype="float32")
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=PREFIX_CACHING)
    if MODEL == "mamba-hybrid":
        cache.mamba_cache_mode = "align" if PREFIX_CACHING else "none"  # align: vLLM's Mamba prefix caching
    if PREFIX_MATCH_UNIT:
        cache.prefix_match_unit = PREFIX_MATCH_UNIT
    cache.num_gpu_blocks = NUM_BLOCKS + 1
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=CHUNKED_PREFILL, is_encoder_decoder=False, async_scheduling=False, policy=POLICY,
        long_prefill_token_threshold=LONG_PREFILL_TOKEN_THRESHOLD,
        long_prefill_token_threshold_adaptive=LONG_PREFILL_TOKEN_THRESHOLD_ADAPTIVE,
        max_num_active_seqs=MAX_NUM_ACTIVE_SEQS, prefill_schedule_interval=PREFILL_SCHEDULE_INTERVAL,
    )
    speculative = (
        SpeculativeConfig(method="ngram", num_speculative_tokens=SPECULATIVE_TOKENS) if SPECULATIVE_TOKENS else None
    )
    transfer = None
    if OFFLOAD_BYTES:
        from vllm.config import KVTransferConfig

        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"cpu_bytes_to_use": OFFLOAD_BYTES},
        )
    lora = None
    if MAX_LORAS:
        from vllm.config import LoRAConfig

        lora = LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=8)
    events = None
    if KV_EVENTS:
        from vllm.config import KVEventsConfig

        events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    config = VllmConfig(
        model_config=model, cache_config=cache, scheduler_config=scheduler_config,
        device_config=DeviceConfig(device="cpu"), speculative_config=speculative, kv_transfer_config=transfer,
        lora_config=lora, kv_events_config=events,
    )
    attention = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    if MODEL == "full":
        layers = [f"model.layers.{index}.self_attn.attn" for index in range(HF_CONFIG["num_hidden_layers"])]
        kv_cache = KVCacheConfig(
            num_blocks=NUM_BLOCKS + 1, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, attention)]
        )
    else:
        kv_cache = planned_kv_cache(config, attention)
    init_none_hash(sha256)
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache, config)
    return Scheduler(
        vllm_config=config, kv_cache_config=kv_cache, structured_output_manager=StructuredOutputManager(config),
        block_size=block_size, hash_block_size=hash_block_size, log_stats=False,
    )


def planned_kv_cache(config, attention):
    """The model's KV cache as a GPU engine core plans it, the hybrid allocator on, the pool's size as the
    block-count override: the R-SWA model's layers (what vLLM's RSWAAttention reports), or the Mamba hybrid's, a
    Jamba's Mamba layer (its state shapes from vLLM's Jamba model class, its page padded to the attention page) and
    its attention layer."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    config.cache_config.num_gpu_blocks_override = NUM_BLOCKS + 1
    config.cache_config.kv_cache_layout = "LBNHC"
    specs = rswa_specs() if RSWA_WINDOW else mamba_specs(config, attention)
    groups = get_global_kv_cache_groups(config, [specs])
    (planned,) = get_kv_cache_configs(config, [specs], [1 << 40], groups)
    assert planned.num_blocks == NUM_BLOCKS + 1, f"vLLM planned {planned.num_blocks} blocks"
    return planned


def rswa_specs():
    from vllm.v1.kv_cache_interface import RSWASpec

    spec = RSWASpec(
        block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32, rswa_window=RSWA_WINDOW
    )
    return {f"model.layers.{index}.self_attn.attn": spec for index in range(HF_CONFIG["num_hidden_layers"])}


def mamba_specs(config, attention):
    from vllm.model_executor.models.jamba import JambaForCausalLM
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba = MambaSpec(
        block_size=config.cache_config.mamba_block_size,
        shapes=JambaForCausalLM.get_mamba_state_shape_from_config(config),
        dtypes=JambaForCausalLM.get_mamba_state_dtype_from_config(config),
        page_size_padded=attention.page_size_bytes,
        mamba_cache_mode=config.cache_config.mamba_cache_mode,
    )
    if MAMBA_CHECKPOINTS:  # a Mamba2 mixer's spec: one checkpoint block, at any position of a chunk
        mamba = dataclasses.replace(mamba, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)
    return {"model.layers.0.mamba": mamba, "model.layers.1.self_attn.attn": attention}


class Runner:
    """The model runner: each request's tokens and table as the SchedulerOutputs tell them, the fake model's tokens
    (SAMPLED[request][position]), greedy verification of the drafts scheduled, and the drafts proposed after a step
    (DRAFTS[request][sequence length])."""

    def __init__(self):
        self.tokens = {}  # request -> prompt and sampled tokens
        self.prompts = {}  # request -> its prompt's length, as the runner's prompt_lens keeps it
        self.tables = {}  # request -> block ids in position order
        self.computed = {}  # request -> computed tokens before this step
        self.preempted = set()  # requests preempted and not scheduled since: their tables are stale
        self.drafts = None  # (request ids, drafts) proposed after the last step

    def consume(self, output):
        for request in output.finished_req_ids:
            self.tokens.pop(request, None)
            self.prompts.pop(request, None)
            self.tables.pop(request, None)
        self.preempted.update(output.preempted_req_ids or ())
        self.computed = {}
        for new in output.scheduled_new_reqs:
            tokens = new.prompt_token_ids if new.prefill_token_ids is None else new.prefill_token_ids
            self.tokens[new.req_id] = list(tokens)
            self.prompts[new.req_id] = len(new.prompt_token_ids)
            self.tables[new.req_id] = list(new.block_ids[0])
            self.computed[new.req_id] = new.num_computed_tokens
            self.preempted.discard(new.req_id)
        cached = output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ())
        for index, request in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[index]
            if request in resumed:
                self.tables[request] = list(blocks[0])
                self.preempted.discard(request)
            elif blocks is not None:
                self.tables[request].extend(blocks[0])
            self.computed[request] = cached.num_computed_tokens[index]

    def execute(self, output):
        order, sampled, lengths = [], [], {}
        for request, count in output.num_scheduled_tokens.items():
            tokens = self.tokens[request]
            end = self.computed[request] + count
            order.append(request)
            if end < len(tokens):  # a prefill chunk that stops short samples nothing
                sampled.append([])
                continue
            known = len(tokens)
            drafts = list(output.scheduled_spec_decode_tokens.get(request, ()))
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == SAMPLED[request][known + accepted]:
                accepted += 1
            new = drafts[:accepted] + [SAMPLED[request][known + accepted]]
            tokens.extend(new)
            sampled.append(new)
            lengths[request] = len(tokens)
        self.drafts = None
        if SPECULATIVE_TOKENS and not getattr(output, "skip_drafts", False):
            proposed = [(request, DRAFTS[request].get(length, [])) for request, length in lengths.items()]
            self.drafts = ([request for request, _ in proposed], [list(drafts) for _, drafts in proposed])
        return order, sampled

    def live_tables(self):
        return {request: table for request, table in self.tables.items() if request not in self.preempted}


class Offloading:
    """The worker side of vLLM's OffloadingConnector: a store ordered by a step is submitted at the next step's start,
    a load at its own step; each completes DELAY(job) steps after its submission (a flushed store, a sync load: at
    once) and is reported in that step's KVConnectorOutput. No K/V is copied: only when jobs complete matters."""

    def __init__(self):
        self.in_flight = {}  # job -> (request, is a load, the step that reports it)
        self.queued = []  # (job, request) stores ordered by the last step

    def due(self, job, step):
        return step + zlib.crc32(repr(("delay", job)).encode()) % (TRANSFER_DELAY + 1)

    def before_forward(self, output, step):
        meta = output.kv_connector_metadata
        flush = set(meta.jobs_to_flush or ())
        for job, entry in list(meta.store_jobs.items()):
            if job in flush:
                del meta.store_jobs[job]
                self.queued.append((job, entry.req_id))
        for job, request in self.queued:
            self.in_flight[job] = (request, False, self.due(job, step))
        self.queued = []
        for job in flush & self.in_flight.keys():
            self.in_flight[job] = (self.in_flight[job][0], False, step)
        for job, entry in meta.load_jobs.items():
            self.in_flight[job] = (entry.req_id, True, step if entry.sync else self.due(job, step))

    def after_forward(self, output, step):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

        for job, entry in output.kv_connector_metadata.store_jobs.items():
            self.queued.append((job, entry.req_id))
        report, recving = OffloadingWorkerMetadata(), set()
        for job, (request, load, due) in sorted(self.in_flight.items()):
            if due <= step:
                del self.in_flight[job]
                if load:
                    recving.add(request)
                report.mark_completed(job)
        return KVConnectorOutput(
            finished_recving=recving or None,
            kv_connector_worker_meta=report if report.completed_jobs else None,
            invalid_block_ids=set(),
        )

    def loading(self):
        return {request for request, load, _ in self.in_flight.values() if load}

    def pending(self):
        return bool(self.in_flight or self.queued)


class Engine:
    """The engine core's synchronous loop around the Scheduler, the runner and the connector's worker side."""

    def __init__(self):
        self.scheduler = build_scheduler()
        self.runner = Runner()
        self.offloading = Offloading() if OFFLOAD_BYTES else None
        self.steps = 0
        self.added = []  # request ids in arrival order
        self.unfinished = set()
        self.lengths = {}  # request -> prompt length + max_tokens
        self.sessions = {}  # streaming sessions left open (resumable requests) -> how their turns are asked
        self.resumable = set()  # every request added resumable, open or closed since

    def add(self, request, prompt, max_tokens, priority=0, cache_salt=None, stop_token_ids=(), eos=False,
            min_tokens=0, lora=0, resumable=False, full_reports=False, skip_reads=False):
        """A request arrives; resumable: a streaming session's first turn, kept open until the drain closes it;
        full_reports: its KV cache events are reported in full (a sampling parameter's extra argument); skip_reads:
        it skips reading the prefix cache (as a request asking for prompt logprobs does)."""
        asked = dict(priority=priority, cache_salt=cache_salt, stop_token_ids=stop_token_ids, eos=eos,
                     min_tokens=min_tokens, lora=lora, full_reports=full_reports, skip_reads=skip_reads)
        self.scheduler.add_request(self.request(request, prompt, max_tokens, resumable, **asked))
        self.added.append(request)
        self.unfinished.add(request)
        self.lengths[request] = len(prompt) + max_tokens
        if resumable:
            self.sessions[request] = asked
            self.resumable.add(request)

    def resume(self, request, prompt, max_tokens):
        """The client continues streaming session request with new input prompt, asking for max_tokens more outputs:
        a request of the same id, resumable, added again with the session's other parameters (min_tokens at most
        max_tokens, as vLLM asks)."""
        asked = dict(self.sessions[request], min_tokens=min(self.sessions[request]["min_tokens"], max_tokens))
        self.scheduler.add_request(self.request(request, prompt, max_tokens, True, **asked))
        self.unfinished.add(request)
        self.lengths[request] += len(prompt) + max_tokens

    def request(self, request, prompt, max_tokens, resumable, priority, cache_salt, stop_token_ids, eos,
                min_tokens, lora, full_reports, skip_reads):
        """vLLM's Request for an add or a session's next turn (arriving after every request added so far)."""
        sampling = SamplingParams(
            max_tokens=max_tokens, ignore_eos=not eos, stop_token_ids=list(stop_token_ids), min_tokens=min_tokens,
            extra_args={"kv_cache_report_mode": "full"} if full_reports else None,
            skip_reading_prefix_cache=True if skip_reads else None,
        )
        sampling.update_from_generation_config({}, EOS_TOKEN)
        lora_request = None
        if lora:
            from vllm.lora.request import LoRARequest

            lora_request = LoRARequest(f"lora-{lora}", lora, f"lora-{lora}")
        return Request(
            request_id=request, prompt_token_ids=list(prompt), sampling_params=sampling, pooling_params=None,
            arrival_time=float(len(self.added)), priority=priority, cache_salt=cache_salt, lora_request=lora_request,
            block_hasher=get_request_block_hasher(HASH_BLOCK_SIZE, sha256),
            **({"resumable": True} if resumable else {}),
        )

    def reset_prefix_cache(self, preempt=False):
        """The client resets the prefix cache (preempt: reset_running_requests), as an RLHF trainer does after a
        weight update."""
        return self.scheduler.reset_prefix_cache(reset_running_requests=preempt)

    def abort(self, request):
        self.scheduler.finish_requests(request, RequestStatus.FINISHED_ABORTED)
        self.unfinished.discard(request)

    def step(self):
        """schedule(), the runner, update_from_output(); the accounting check right after the runner read the
        output. Returns the tokens scheduled."""
        output = self.scheduler.schedule()
        self.steps += 1
        self.check_batch(output)
        self.runner.consume(output)
        if MODEL == "full":  # the runner's tables are the first KV-cache group's
            self.check_accounting()
        if RSWA_WINDOW:
            self.check_reads(output)
        if self.offloading:
            self.offloading.before_forward(output, self.steps)
        order, sampled = self.runner.execute(output)
        connector = self.offloading.after_forward(output, self.steps) if self.offloading else None
        fields = {field.name for field in dataclasses.fields(ModelRunnerOutput)}
        index = {"req_id_to_index": {r: n for n, r in enumerate(order)}} if "req_id_to_index" in fields else {}
        result = ModelRunnerOutput(req_ids=order, sampled_token_ids=sampled, kv_connector_output=connector, **index)
        for outputs in self.scheduler.update_from_output(output, result).values():
            for reported in outputs.outputs:
                if reported.finish_reason is not None and not self.continues(reported.request_id):
                    self.unfinished.discard(reported.request_id)
        drafts, self.runner.drafts = self.runner.drafts, None
        if drafts is not None and output.total_num_scheduled_tokens > 0:
            self.scheduler.update_draft_token_ids(DraftTokenIds(*drafts))
        return output.total_num_scheduled_tokens

    def continues(self, request):
        """Whether a request whose turn just ended goes on: a streaming session with an update queued at its stop
        takes it as its next turn (vLLM keeps it, neither finished nor paused)."""
        held = self.scheduler.requests.get(request)
        return (
            request in self.resumable and held is not None and not held.is_finished()
            and held.status != RequestStatus.WAITING_FOR_STREAMING_REQ
        )

    def check_batch(self, output):
        """Every request the step schedules tokens for is one the output brings, new or cached: the model runner
        holds a table only for those (a request the same output preempts is neither)."""
        new = sorted(request.req_id for request in output.scheduled_new_reqs)
        cached = sorted(output.scheduled_cached_reqs.req_ids)
        preempted = set(output.preempted_req_ids or ())
        for request, count in sorted(output.num_scheduled_tokens.items()):
            if request not in new and request not in cached:
                also = " (the same output preempts it)" if request in preempted else ""
                raise Failure(
                    f"batch at step {self.steps}: the output schedules {count} token(s) for {request}{also}, but "
                    f"brings it neither as a new nor as a cached request, so the model runner has no table for it; "
                    f"new {new}, cached {cached}"
                )

    def check_reads(self, output):
        """R-SWA: every position a scheduled token attends maps to a real block of the runner's table: the prompt
        (its length as the runner's prompt_lens, the R-SWA mask's prefix, has it) and the RSWA_WINDOW positions up to
        each token."""
        for request, count in output.num_scheduled_tokens.items():
            start = self.runner.computed[request]
            end, prompt = start + count, self.runner.prompts[request]
            table = self.runner.tables[request]
            first = max(0, start - RSWA_WINDOW + 1)
            for position in [*range(min(prompt, first)), *range(first, end)]:
                entry = position // BLOCK_SIZE
                if entry < len(table) and table[entry] == 0:
                    read = "its prompt" if position < prompt else "its window"
                    raise Failure(
                        f"content at step {self.steps}: {request}'s position {position} ({read}: a prompt of {prompt} "
                        f"tokens, a window of {RSWA_WINDOW}) maps to vLLM's null block 0 (table {table}), but the "
                        f"model runner attends it"
                    )

    def check_accounting(self):
        """Every block a live request's table holds has ref_cnt equal to the tables holding it and is not free;
        every other block is free: the manager's free count is the usable blocks less the distinct blocks held. A
        request waiting with blocks (kv_holding_waiting, or its load in flight) holds the blocks of vLLM's own table
        for it."""
        held = self.runner.live_tables()
        waiting = {request.request_id for request in getattr(self.scheduler, "kv_holding_waiting", ())}
        loading = self.offloading.loading() if self.offloading else set()
        for request in sorted(waiting | loading):
            if request in self.scheduler.requests and request not in held:
                (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(request)
                held[request] = list(blocks)
        holders = {}
        for request, table in held.items():
            for block in table:
                if block != 0:
                    holders.setdefault(block, []).append(request)
        pool = self.scheduler.kv_cache_manager.block_pool
        free = {block.block_id for block in pool.free_block_queue.get_all_free_blocks()}
        for block, requests in sorted(holders.items()):
            if block in free or pool.blocks[block].ref_cnt != len(requests):
                where = "is in the free queue" if block in free else f"has ref_cnt {pool.blocks[block].ref_cnt}"
                raise Failure(
                    f"accounting at step {self.steps}: block {block} is held by the tables of {len(requests)} "
                    f"request(s) {requests} (expected ref_cnt {len(requests)}, not free), but the pool's block {where}"
                )
        usable = len(pool.blocks) - 1
        reported = pool.get_num_free_blocks()
        if reported != usable - len(holders):
            lost = [b.block_id for b in pool.blocks[1:] if b.block_id not in free and b.block_id not in holders]
            owners = []
            for request_id, request in sorted(self.scheduler.requests.items()):
                (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(request_id)
                mine = sorted(set(lost) & set(blocks))
                if mine:
                    queue = next(
                        (name for name in ("running", "kv_holding_waiting", "waiting")
                         if any(queued is request for queued in getattr(self.scheduler, name, ()))),
                        "no queue",
                    )
                    owners.append(f"blocks {mine} in vLLM's table for {request_id} ({request.status.name}, "
                                  f"{request.num_computed_tokens} computed, in scheduler.{queue})")
            raise Failure(
                f"accounting at step {self.steps}: the pool reports {reported} free blocks, but the requests' "
                f"tables hold {len(holders)} distinct blocks of {usable}, so {usable - len(holders)} must be free; "
                f"blocks neither free nor in a table: {lost}" + "".join(f"; {owner}" for owner in owners)
            )

    def drain(self):
        """Arrivals stopped: step until every request finished, at most 4 x their tokens + 16 steps (each step
        computes a token unless the engine is stuck); a request left unfinished is the hang."""
        # the client closes every open session with a request of its id, not resumable: a session whose turn has
        # ended is aborted, one still running finishes at its turn's stop
        for request in sorted(self.sessions, key=self.added.index):
            self.scheduler.add_request(Request(
                request_id=request, prompt_token_ids=[0], sampling_params=SamplingParams(max_tokens=1),
                pooling_params=None, arrival_time=float(len(self.added)),
                block_hasher=get_request_block_hasher(HASH_BLOCK_SIZE, sha256),
            ))
        self.sessions = {}
        bound = 4 * sum(self.lengths[request] for request in self.unfinished) + 16
        for _ in range(bound):
            if not self.unfinished:
                break
            self.step()
        if self.unfinished:
            stuck = []
            for request in sorted(self.unfinished, key=self.added.index):
                held = self.scheduler.requests.get(request)
                state = "unknown to the scheduler" if held is None else (
                    f"{held.status.name}, {held.num_computed_tokens} computed, {held.num_output_tokens} output tokens"
                )
                stuck.append(f"{request} ({state})")
            raise Failure(
                f"progress: {len(stuck)} request(s) still unfinished {bound} steps after arrivals stopped "
                f"(step {self.steps}): " + "; ".join(stuck)
            )
'''
