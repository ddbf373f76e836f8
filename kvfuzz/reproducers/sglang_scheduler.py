"""Reproducers of SGLang scheduler traces (the ``sglang`` scheduler target, :mod:`kvfuzz.scheduler.sglang`): one
Python file that imports SGLang, torch and the standard library only, builds the scheduling pieces the target
builds (the paged token pool, the ``ReqToTokenPool``, the ``UnifiedRadixCache``, the ``SchedulePolicy``), admits
each request through SGLang's own ``Scheduler.init_req_max_new_tokens`` and ``validate_input_length`` (compiled
alone from SGLang's installed source, as the target runs them: their modules need packages a CPU install lacks),
steps them as the target's loop steps ``get_next_batch_to_run`` and ``process_batch_result`` (``PrefillAdder``,
``ScheduleBatch``, the radix cache's checkpoint and release), with the fake model's tokens written into the file,
then drains.

Only the progress check is stated (a hang: requests SGLang accepted that no step schedules): it needs nothing but
SGLang's own state. The reproducer fails with ``Failure('progress ...')`` naming the request at the head of the
waiting queue, the running batch, the pool's free and evictable tokens, and the step's ``PrefillAdder`` verdict on
the request with the numbers it decided on. Every other check (content, outputs, accounting) and a crash are
refused with the reason (:class:`NotReproducible`)."""

from __future__ import annotations

import json
import re

from kvfuzz.reproducers.program import NotReproducible, comment
from kvfuzz.reproducers.sglang_radix import SGLANG_IMPORT
from kvfuzz.scheduler.fake_model import EOS_TOKEN, sampled_token
from kvfuzz.scheduler.program import AddRequest
from kvfuzz.scheduler.reproducer import program_calls
from kvfuzz.scheduler.trace import SGLANG, SchedulerTrace

SCHEDULER = SGLANG
ENGINE = "SGLang"
EXPRESSED = ("progress",)
"""The recorded failures a reproducer states on SGLang's objects."""

HOW = (
    "It builds SGLang's scheduling pieces on the CPU as kvfuzz's SGLang target does (the paged token pool, the "
    "`ReqToTokenPool`, the `UnifiedRadixCache`, the `SchedulePolicy`), admits each request through SGLang's own "
    "`Scheduler.init_req_max_new_tokens` and `validate_input_length`, steps the waiting queue and the running batch "
    "as `get_next_batch_to_run` and `process_batch_result` do (`PrefillAdder`, `ScheduleBatch`, the radix cache's "
    "checkpoint and release) with the fake model's tokens, and asserts the hang on SGLang's own state: a request "
    "still waiting while steps schedule nothing, with the step's `PrefillAdder` verdict on it and the numbers it "
    "decided on."
)
"""What the report says the reproducer does."""


def check(trace: SchedulerTrace) -> None:
    """Raise :class:`NotReproducible` unless the reproducer states ``trace``'s failure."""
    if trace.scheduler != SGLANG:
        raise NotReproducible(f"a {trace.scheduler} trace: this reproducer plays SGLang's scheduler only")
    if trace.failure.check not in EXPRESSED:
        raise NotReproducible(
            f"its failure is kvfuzz's {trace.failure.check} check: an SGLang scheduler reproducer states only "
            f"{', '.join(EXPRESSED)} (a hang) on SGLang's own objects"
        )


def _sampled(trace: SchedulerTrace) -> dict[str, list[int]]:
    """The fake model's token at every position each request can reach (its prompt's positions included)."""
    adds = [operation for operation in trace.program if isinstance(operation, AddRequest)]
    return {
        f"r{index}": [sampled_token(f"r{index}", position) for position in range(len(add.prompt) + add.max_tokens + 2)]
        for index, add in enumerate(adds)
    }


def constants(trace: SchedulerTrace) -> str:
    setup = trace.setup
    return f"""NUM_PAGES = {setup.num_blocks}  # allocatable pages 1..NUM_PAGES; page 0 is SGLang's padding page
PAGE_SIZE = {setup.block_size}
CHUNKED_PREFILL_SIZE = {setup.max_num_batched_tokens}  # also max_prefill_tokens
MAX_RUNNING_REQUESTS = {setup.max_num_seqs}
RADIX_CACHE = {setup.prefix_caching}  # False: --disable-radix-cache
CONTEXT_LEN = {setup.max_model_len + 1}  # the model's context length: longer than the pool, so the pool bounds requests
SCHEDULE_CONSERVATIVENESS = {setup.schedule_conservativeness!r}
EOS_TOKEN = {EOS_TOKEN}  # the model's EOS token: ends a request that does not ignore EOS

# ---- the fake model: the token it samples for a request when its sequence has that many tokens ----
SAMPLED = {json.dumps(_sampled(trace))}
"""


def _add(operation: AddRequest, request: str) -> str:
    # the target refuses the rest of an add's fields on SGLang, so a trace holds only these
    ignore_eos = "" if operation.eos else ", ignore_eos=True"
    return f'engine.add("{request}", {list(operation.prompt)}, max_new_tokens={operation.max_tokens}{ignore_eos})'


def reproducer_source(trace: SchedulerTrace, source: str) -> str:
    """The reproducer's text (``source``: the trace file, as named). Raises :class:`NotReproducible`."""
    check(trace)
    name = re.sub(r"[^a-z0-9]+", "_", f"sglang {trace.failure.check} {trace.digest()}".lower()).strip("_")
    body = "\n".join(f"    {call}" for call in program_calls(trace, _add))
    known = f"{comment('Known bug: ' + trace.known_bug)}\n" if trace.known_bug else ""
    return f'''"""Standalone reproducer of an SGLang scheduler hang kvfuzz found (generated by kvfuzz report from
{source.replace(chr(92), "/").replace('"""', "")}). It imports SGLang, torch and the standard library only.

Run it where SGLang is installed: python THIS_FILE (exit status 1 and the failure while it reproduces, 0 once fixed),
or pytest THIS_FILE. Recorded against SGLang {trace.vllm_version}. Expected while the bug is there: a request SGLang
accepted is never admitted: engine.drain() raises Failure('progress: ...') with PrefillAdder's verdict on it.
"""

{comment("Recorded failure: " + trace.failure.describe())}
{known}
# ---- the trace's configuration (kvfuzz: {trace.setup.describe()}) ----
{constants(trace)}{RUNTIME}

# ---- the client's program, then the drain ----
def test_{name}():
    engine = Engine()
{body}
    engine.drain()


if __name__ == "__main__":
    test_{name}()
    print("passed: the failure does not reproduce")
'''


RUNTIME = (
    "\n# ---- SGLang's scheduling pieces, stepped as its Scheduler steps them (the same in every such reproducer) "
    + "-" * 8
    + SGLANG_IMPORT
    + r'''
import ast
import importlib.util
import logging
import typing

from sglang.srt.environ import envs
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import (
    CLIP_MAX_NEW_TOKENS, IGNORE_EOS_RESERVE_TOKENS, AddReqResult, PrefillAdder, SchedulePolicy,
)
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import create_context, use_context
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

CONTEXT = create_context(ServerArgs(model_path="dummy", device="cpu"), role="scheduler")
MAX_TOTAL_NUM_TOKENS = NUM_PAGES * PAGE_SIZE
MAX_REQ_LEN = min(CONTEXT_LEN, MAX_TOTAL_NUM_TOKENS) - 1  # TpModelWorker's max_req_len
MAX_REQ_INPUT_LEN = MAX_REQ_LEN - 5  # TpModelWorker's max_req_input_len
# NewTokenRatioTracker.from_config: the share of a running request's remaining output the PrefillAdder reserves
NEW_TOKEN_RATIO = min(envs.SGLANG_INIT_NEW_TOKEN_RATIO.get() * SCHEDULE_CONSERVATIVENESS, 1.0)
MIN_NEW_TOKEN_RATIO = min(NEW_TOKEN_RATIO * envs.SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR.get(), 1.0)
NEW_TOKEN_RATIO_DECAY = (NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / envs.SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS.get()
STUCK_STEPS = 10  # steps that schedule nothing, in a row, with requests unfinished: the hang


class Failure(AssertionError):
    """A request SGLang accepted that its scheduler never runs, stated on SGLang's own objects."""


def sglang_function(module, qualified):
    """SGLang's own function `qualified` ("name" or "Class.name") of `module`, compiled alone from its installed
    source: sglang.srt.managers.scheduler and .utils do not import without setproctitle, einops, uvicorn and FastAPI,
    which a CPU-only install lacks. On a full install it is the very function the module defines."""
    origin = importlib.util.find_spec(module).origin
    with open(origin, encoding="utf-8") as stream:
        body = ast.parse(stream.read(), origin).body
    *owner, name = qualified.split(".")
    for part in owner:
        body = next(node.body for node in body if isinstance(node, ast.ClassDef) and node.name == part)
    definition = next(node for node in body if isinstance(node, ast.FunctionDef) and node.name == name)
    definition.decorator_list = []
    namespace = {"logger": logging.getLogger(module), "Optional": typing.Optional, "Req": object}  # what it names
    exec(compile(ast.Module(body=[definition], type_ignores=[]), origin, "exec"), namespace)
    return namespace[name]


init_req_max_new_tokens = sglang_function("sglang.srt.managers.scheduler", "Scheduler.init_req_max_new_tokens")
validate_input_length = sglang_function("sglang.srt.managers.utils", "validate_input_length")


class SchedulerLimits:
    """The Scheduler attributes init_req_max_new_tokens reads: one shard, no sliding window."""

    def __init__(self, token_to_kv_pool_allocator):
        self.max_new_tokens_limit = envs.SGLANG_MAX_NEW_TOKENS_LIMIT.get()
        self.max_req_len = MAX_REQ_LEN
        self.max_total_num_tokens = MAX_TOTAL_NUM_TOKENS
        self.page_size = PAGE_SIZE
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.chunked_prefill_size = CHUNKED_PREFILL_SIZE
        self.kv_shard_widening = 1
        self.sliding_window_size = None


class RequestForRules:
    """What the two rules read and write of a Req (its prompt, its sampling parameters, whose max_new_tokens the
    clip sets), the abort they may set recorded instead of finishing the Req."""

    def __init__(self, req):
        self.rid, self.origin_input_ids, self.sampling_params = req.rid, req.origin_input_ids, req.sampling_params
        self.refusal = None

    def set_finish_with_abort(self, error_msg, *args, **kwargs):
        self.refusal = error_msg


class ModelConfig:
    """What ScheduleBatch reads of the model configuration."""

    vocab_size = 4
    is_encoder_decoder = False
    hf_text_config = None


class Engine:
    """SGLang's scheduler state for the KV cache (waiting queue, running batch, chunked request), stepped as
    Scheduler.get_next_batch_to_run and process_batch_result step it under synchronous scheduling (no overlap,
    speculation, mixed chunks, priority, hierarchical cache); the model samples SAMPLED[request][sequence length]."""

    def __init__(self):
        with use_context(CONTEXT):
            self.token_pool = PagedTokenToKVPoolAllocator(
                MAX_TOTAL_NUM_TOKENS, page_size=PAGE_SIZE, dtype=torch.float16, device="cpu", kvcache=None,
                need_sort=False,
            )
            self.req_to_token_pool = ReqToTokenPool(
                size=MAX_RUNNING_REQUESTS + 1, max_context_len=CONTEXT_LEN + PAGE_SIZE, device="cpu",
                enable_memory_saver=False,
            )
            params = CacheInitParams(
                disable=not RADIX_CACHE, req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.token_pool, page_size=PAGE_SIZE,
            )
            params.tree_components = (ComponentType.FULL,)  # a full-attention model, as create_unified_radix_cache
            self.tree_cache = UnifiedRadixCache(params)
            self.policy = SchedulePolicy(
                "lpm" if RADIX_CACHE else "fcfs", self.tree_cache, enable_hierarchical_cache=False,
                enable_priority_scheduling=False, schedule_low_priority_values_first=False,
            )
        self.waiting_queue = []
        self.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        self.chunked_req = None
        self.last_batch = None
        self.new_token_ratio = NEW_TOKEN_RATIO
        self.reqs = {}  # request id -> Req
        self.asked = {}  # request id -> the max_new_tokens the client asked for
        self.tokens = {}  # request id -> its prompt and the tokens sampled for it
        self.unfinished = []  # requests accepted and not finished, in arrival order
        self.steps = 0
        self.verdicts = {}  # request id -> (AddReqResult, PrefillAdder) of the last step's admission loop

    # -- handle_generate_request -------------------------------------------------------------------------------
    def add(self, rid, prompt, max_new_tokens, ignore_eos=False):
        """A Req with the model's EOS token, its max_new_tokens clipped (init_req_max_new_tokens) and its prompt
        validated (validate_input_length, no auto-truncation) by SGLang's own code, then queued; a refused one is
        finished at once."""
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
        params.normalize(None)  # as the tokenizer manager does (no stop strings)
        req = Req(rid, "", array("q", prompt), params, eos_token_ids={EOS_TOKEN})
        rules = RequestForRules(req)
        init_req_max_new_tokens(SchedulerLimits(self.token_pool), rules)
        refusal = rules.refusal or validate_input_length(rules, MAX_REQ_INPUT_LEN, False)
        self.reqs[rid], self.asked[rid], self.tokens[rid] = req, max_new_tokens, list(prompt)
        if refusal is not None:
            req.finished_reason = FINISH_ABORT()
            print(f"{rid}: refused by SGLang: {refusal}")
            return
        self.waiting_queue.append(req)
        self.unfinished.append(rid)

    def abort(self, rid):
        """abort_request: a waiting request is dropped; a running one finishes when its next result is processed."""
        req = self.reqs[rid]
        if rid in self.unfinished:
            self.unfinished.remove(rid)
        if req.finished():
            return
        if req in self.waiting_queue:
            self.waiting_queue.remove(req)
            req.finished_reason = FINISH_ABORT()
            if req.kv.holds_kv:
                with use_context(CONTEXT):
                    release_kv_cache(req, self.tree_cache, checkpoint=False)
        else:
            req.to_finish = FINISH_ABORT()

    # -- get_next_batch_to_run ---------------------------------------------------------------------------------
    def next_batch(self):
        """The last prefill merged into the running batch (its chunked request checkpointed into the tree), then a
        new prefill batch if the PrefillAdder admits any, else the running batch's decode."""
        excluded = []
        if self.chunked_req is not None:
            excluded.append(self.chunked_req)
            if self.chunked_req.extend_end > self.chunked_req.prefix_len:
                checkpoint_kv_cache(self.chunked_req, self.tree_cache)
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
        batch = self.new_prefill_batch()
        if batch is None and not self.running_batch.is_empty():
            batch = self.update_running_batch(self.running_batch)
            batch = None if batch is None or batch.is_empty() else batch
        self.last_batch = batch
        return batch

    def allocatable(self, running_bs, held_rows):
        """get_num_allocatable_reqs."""
        return min(MAX_RUNNING_REQUESTS - running_bs, self.req_to_token_pool.available_size() + held_rows)

    def new_prefill_batch(self):
        """_get_new_batch_prefill_raw: the PrefillAdder over the waiting queue; its verdict on each request kept."""
        running = self.running_batch
        if running.is_empty():
            running.batch_is_full = False
        if (running.batch_is_full or not self.waiting_queue) and self.chunked_req is None:
            return None
        if self.allocatable(len(running.reqs), 0) <= 0 and self.chunked_req is None:
            running.batch_is_full = True
            return None
        self.policy.calc_priority(self.waiting_queue, running)
        adder = PrefillAdder(
            PAGE_SIZE, self.tree_cache, self.token_pool, running, self.new_token_ratio, CHUNKED_PREFILL_SIZE,
            CHUNKED_PREFILL_SIZE, 0, max_running_requests=MAX_RUNNING_REQUESTS,
            waiting_queue_len=len(self.waiting_queue),
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            adder.chunked_req_limit = self.policy.shortest_prefill_chunk_limit(
                self.chunked_req, self.waiting_queue, adder.rem_chunk_tokens or 0, PAGE_SIZE
            )
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in self.waiting_queue:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            held = sum(r.kv.holds_kv for r in adder.can_run_list)
            if len(adder.can_run_list) >= self.allocatable(len(running.reqs), held):
                running.batch_is_full = True
            if running.batch_is_full:
                break
            req.init_next_round_input(self.tree_cache)
            result = adder.add_one_req(req, has_chunked_req=self.chunked_req is not None, truncation_align_size=None)
            self.verdicts[req.rid] = (result, adder)
            if result != AddReqResult.CONTINUE:
                if result == AddReqResult.NO_TOKEN:
                    running.batch_is_full = len(adder.can_run_list) > 0 or not running.is_empty()
                break
        if not adder.can_run_list:
            return None
        chosen = set(adder.can_run_list)
        self.waiting_queue = [req for req in self.waiting_queue if req not in chosen]
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        batch = ScheduleBatch.init_new(
            adder.can_run_list, self.req_to_token_pool, self.token_pool, self.tree_cache, ModelConfig(), False,
            SpeculativeAlgorithm.NONE, chunked_req=self.chunked_req,
        )
        batch.prepare_for_extend()
        batch.decoding_reqs = None
        return batch

    def update_running_batch(self, batch):
        """update_running_batch: retract under memory pressure, then prepare_for_decode."""
        initial = batch.batch_size()
        batch.filter_batch()
        if batch.is_empty():
            batch.batch_is_full = False
            return batch
        if not batch.check_decode_mem():
            retracted, self.new_token_ratio, aborted = batch.retract_decode()
            for req in aborted:
                if req.rid in self.unfinished:
                    self.unfinished.remove(req.rid)
            self.waiting_queue.extend(retracted)
        else:
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
        if batch.batch_size() < initial:
            batch.batch_is_full = False
        if batch.is_empty():
            return batch
        batch.prepare_for_decode()
        return batch

    # -- the model, and process_batch_result -------------------------------------------------------------------
    def step(self):
        """get_next_batch_to_run, the model, process_batch_result. Returns the tokens the batch scheduled."""
        self.verdicts = {}
        with use_context(CONTEXT):
            batch = self.next_batch()
            self.steps += 1
            if batch is None:
                return 0
            extend = batch.forward_mode.is_extend()
            if extend:
                ends = [int(p) + int(n) for p, n in zip(batch.prefix_lens, batch.extend_lens)]
                scheduled = sum(int(n) for n in batch.extend_lens)
            else:  # prepare_for_decode has counted the new token into seq_lens
                ends = [int(n) for n in batch.seq_lens.tolist()]
                scheduled = len(ends)
            sampled = []
            for req, end in zip(batch.reqs, ends):
                tokens = self.tokens[req.rid]
                if end == len(tokens):  # the batch reaches the sequence's end: the model samples a token
                    tokens.append(SAMPLED[req.rid][end])
                    sampled.append(tokens[-1])
                else:
                    sampled.append(0)  # a prefill chunk short of the prompt's end: SGLang discards its token
            self.process(batch, sampled, extend)
        return scheduled

    def process(self, batch, sampled, extend):
        """process_batch_result_prefill / _decode: each request's token appended, its finish state updated, a
        finished request's KV released into the tree and a prefilled one's checkpointed."""
        for req, token in zip(batch.reqs, sampled):
            if req.is_retracted or req.finished():
                continue
            if extend and req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1
                continue
            req.output_ids.append(token)
            if extend:
                req.update_finish_state()
            else:
                req.update_finish_state(1)
            if req.finished():
                release_kv_cache(req, self.tree_cache, checkpoint=True)
                if req.rid in self.unfinished:
                    self.unfinished.remove(req.rid)
            elif extend:
                checkpoint_kv_cache(req, self.tree_cache)

    # -- the drain, and the progress check ---------------------------------------------------------------------
    def drain(self):
        """Arrivals stopped: step until every request finished, at most 4 x their tokens + 16 steps. STUCK_STEPS
        steps in a row that schedule nothing, with requests unfinished, are a hang; so is running past the bound."""
        bound = 4 * sum(len(self.reqs[r].origin_input_ids) + self.asked[r] for r in self.unfinished) + 16
        idle = 0
        for _ in range(bound):
            if not self.unfinished:
                return
            idle = 0 if self.step() else idle + 1
            if idle == STUCK_STEPS:
                raise Failure(self.hang())
        if self.unfinished:
            raise Failure(f"progress: {self.unfinished} still unfinished {bound} steps after arrivals stopped")

    def where(self, req):
        if req in self.waiting_queue:
            return f"waiting ({self.waiting_queue.index(req) + 1} of {len(self.waiting_queue)} in the queue)"
        if req is self.chunked_req:
            return "the chunked request"
        return "running" if req in self.running_batch.reqs else "nowhere in the scheduler"

    def hang(self):
        """Why nothing is scheduled, in SGLang's terms: the requests, the pool, and the PrefillAdder's verdict on the
        head of the waiting queue with the numbers it decided on."""
        free = self.token_pool.available_size()
        evictable = 0 if self.tree_cache.disable else int(self.tree_cache.evictable_size())
        lines = [
            f"progress: {len(self.unfinished)} request(s) accepted and unfinished, and the last {STUCK_STEPS} steps "
            f"(to step {self.steps}) scheduled nothing: "
            + "; ".join(f"{rid} {self.where(self.reqs[rid])}" for rid in self.unfinished),
            f"  running batch: {len(self.running_batch.reqs)} request(s); chunked request: "
            f"{self.chunked_req.rid if self.chunked_req is not None else 'none'}; token pool: {free} of "
            f"{MAX_TOTAL_NUM_TOKENS} tokens free ({NUM_PAGES} pages of {PAGE_SIZE}), {evictable} evictable in the tree",
        ]
        if self.waiting_queue:
            lines += self.verdict(self.waiting_queue[0])
        return "\n".join(lines)

    def verdict(self, req):
        """The last step's PrefillAdder verdict on `req`, the numbers it decided on, and what the request asked."""
        rid, params = req.rid, req.sampling_params
        asked = [
            f"  {rid}: prompt {len(req.origin_input_ids)} tokens (validate_input_length accepts fewer than "
            f"max_req_input_len {MAX_REQ_INPUT_LEN}; max_req_len {MAX_REQ_LEN}), max_new_tokens {self.asked[rid]} "
            f"asked, {params.max_new_tokens} after init_req_max_new_tokens, ignore_eos {params.ignore_eos}"
        ]
        if rid not in self.verdicts:
            return asked + [f"  the last step's PrefillAdder did not consider {rid}"]
        result, adder = self.verdicts[rid]
        extend = len(req.full_untruncated_fill_ids) - req.prefix_len
        max_new = min(max(params.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
        overhead = adder.per_req_token_overhead
        if params.ignore_eos and self.tree_cache.disable:
            paged = adder.ceil_paged_tokens(extend) + overhead
            left = adder.cur_rem_tokens - paged - max_new
            why = (
                f"add_one_req_ignore_eos (ignore_eos, radix cache disabled): of cur_rem_tokens {adder.cur_rem_tokens}, "
                f"the paged input ceil_paged_tokens({extend}) + per_req_token_overhead {overhead} = {paged} and the "
                f"{max_new} output tokens left leave {left}, which must exceed IGNORE_EOS_RESERVE_TOKENS "
                f"{IGNORE_EOS_RESERVE_TOKENS}"
            )
        else:
            total = extend + max_new + overhead
            why = (
                f"add_one_req: total_tokens = extend {extend} (prefix hit {req.prefix_len}) + max_new {max_new} + "
                f"per_req_token_overhead {overhead} = {total}, which must be below rem_total_tokens "
                f"{adder.rem_total_tokens}"
            )
        return asked + [f"  PrefillAdder.add_one_req({rid}) returned {result.name}: {why}"]
'''
)
