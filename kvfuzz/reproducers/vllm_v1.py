"""Reproducers of traces of ``kvfuzz.adapters.vllm_v1`` (vLLM v1's ``KVCacheManager`` driven as its scheduler drives
it): a ``Session`` that makes the adapter's calls on a real ``KVCacheManager`` (admission: ``get_computed_blocks``
then ``allocate_slots``; a free or preemption: ``KVCacheManager.free`` and the request reset as
``Scheduler._preempt_request`` resets it; a step: the in-flight tokens completed and ``new_step_starts``), with the
account of :mod:`kvfuzz.reproducers.book` for cache soundness, and vLLM's eviction order checked at each allocation
(a block holding a cached hash is taken for new content only once the free queue holds no block without one)."""

from __future__ import annotations

import json

from kvfuzz.reproducers.program import NotReproducible
from kvfuzz.saved.trace import Trace

ADAPTER = "kvfuzz.adapters.vllm_v1"
FACTORIES = ("kv_cache_manager", "kv_cache_manager_priority", "kv_cache_manager_kv_connector")
"""The factories the session plays: full attention, prefix caching, namespaces as cache salts, W = 0."""

OPERATIONS = frozenset({"admit", "readmit", "grow", "decode", "free", "preempt", "step", "evict_blocks"})
ENGINE = "vLLM"


def key_of(namespace: tuple[str, ...]) -> object:
    """A namespace as the adapter's cache salt (None for the empty one)."""
    return json.dumps(list(namespace)) if namespace else None


def check(trace: Trace) -> None:
    factory = trace.allocator.split(":")[1]
    if factory not in FACTORIES:
        raise NotReproducible(f"factory {factory}: the reproducer's session plays only {', '.join(FACTORIES)}")


def constants(trace: Trace) -> str:
    config = trace.config
    return (
        f"BLOCK_SIZE = {config.block_size}\nNUM_BLOCKS = {config.num_blocks}  # vLLM gets one more, its null block 0\n"
    )


RUNTIME = r'''
# ---- vLLM's KVCacheManager driven as vLLM's v1 scheduler drives it (the same in every such reproducer) ------------
import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

MAX_MODEL_LEN = 1 << 20


class Session:
    """One KVCacheManager over NUM_BLOCKS usable blocks (and vLLM's null block 0), prefix caching on; each request a
    vLLM Request hashed by vLLM's own block hasher; the scheduler's calls, synchronous (no batch in flight)."""

    def __init__(self):
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
        config = KVCacheConfig(
            num_blocks=NUM_BLOCKS + 1, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["attn"], spec)]
        )
        self.manager = KVCacheManager(
            config, max_model_len=MAX_MODEL_LEN, scheduler_block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE,
            enable_caching=True,
        )
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.book = Book(BLOCK_SIZE, lands_on_free=True)  # an aborted request's scheduled step still runs
        self.running = {}  # request id -> Request
        self.preempted = {}  # request id -> Request, reset as the scheduler resets a preempted request
        self.salts = {}  # request id -> its cache salt
        self.in_flight = []  # (Request, tokens) scheduled since the last step

    def slots(self, request_id, count):
        """(vLLM block id, offset) of the request's positions 0..count-1, off vLLM's table for it."""
        (blocks,) = self.manager.get_block_ids(request_id)
        return [(blocks[position // BLOCK_SIZE], position % BLOCK_SIZE) for position in range(count)]

    def free_queue(self):
        """The free queue, head (evicted first) to tail: (block id, whether it holds a cached hash)."""
        blocks = self.manager.block_pool.free_block_queue.get_all_free_blocks()
        return [(block.block_id, block.block_hash is not None) for block in blocks]

    def admit(self, request_id, cache_salt, tokens):
        """get_computed_blocks (the prefix hit), then allocate_slots for the rest of the prompt; a refusal leaves the
        request out."""
        request = self.preempted.get(request_id) or Request(
            request_id=request_id, prompt_token_ids=list(tokens), pooling_params=None, cache_salt=cache_salt,
            sampling_params=SamplingParams(max_tokens=MAX_MODEL_LEN), block_hasher=self.hasher,
        )
        self.salts[request_id] = cache_salt
        hit, num_hit, _ = self.manager.get_computed_blocks(request)
        num_new = request.num_tokens - num_hit
        before = self.free_queue()
        allocated = self.manager.allocate_slots(
            request, num_new, num_new_computed_tokens=num_hit, new_computed_blocks=hit
        )
        if allocated is None:
            print(f"(admission of {request_id} refused: {self.manager.block_pool.get_num_free_blocks()} free blocks)")
            return
        self.preempted.pop(request_id, None)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit + num_new
        request.num_in_flight_tokens += num_new
        self.in_flight.append((request, num_new))
        self.running[request_id] = request
        self.check_eviction_order(f"admission of {request_id}", before, request_id, num_hit // BLOCK_SIZE)
        tokens = list(request.all_token_ids)
        slots = self.slots(request_id, len(tokens))
        self.book.hit(request_id, cache_salt, tokens, slots, num_hit)
        self.book.schedule(request_id, cache_salt, tokens, slots, num_hit)

    def readmit(self, request_id):
        """A preempted request comes back with every token it had."""
        self.admit(request_id, self.salts[request_id], list(self.preempted[request_id].all_token_ids))

    def grow(self, request_id, tokens):
        """update_from_output appends the sampled tokens; allocate_slots for them (a refusal takes them back)."""
        request = self.running[request_id]
        old = request.num_tokens
        request.append_output_token_ids(list(tokens))
        before = self.free_queue()
        if self.manager.allocate_slots(request, len(tokens)) is None:
            del request._all_token_ids[old:]
            del request._output_token_ids[max(0, old - request.num_prompt_tokens):]
            del request.block_hashes[old // BLOCK_SIZE:]
            print(f"(grow of {request_id} refused)")
            return
        request.num_computed_tokens += len(tokens)
        request.num_in_flight_tokens += len(tokens)
        self.in_flight.append((request, len(tokens)))
        self.check_eviction_order(f"grow of {request_id}", before, request_id, -(-old // BLOCK_SIZE))
        all_tokens = list(request.all_token_ids)
        self.book.schedule(request_id, self.salts[request_id], all_tokens, self.slots(request_id, len(all_tokens)), old)

    def decode(self, token):
        """One iteration: every request whose tokens a step computed appends `token`, then a step runs."""
        for request_id in [r for r in self.running if r not in self.book.scheduled]:
            self.grow(request_id, [token])
        self.step()

    def free(self, request_id):
        """The request finishes or is aborted: KVCacheManager.free."""
        request = self.running.pop(request_id)
        request.status = RequestStatus.FINISHED_ABORTED
        self.manager.free(request)
        self.book.freed(request_id)

    def preempt(self, request_id):
        """Scheduler._preempt_request: free the blocks, reset the request to be recomputed."""
        request = self.running.pop(request_id)
        self.manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.preempted[request_id] = request
        self.book.withdraw(request_id, f"the preemption of {request_id}")

    def evict_blocks(self, blocks):
        """A KV connector reports blocks to drop (kvfuzz numbers blocks from 0, vLLM from its null block 0)."""
        self.manager.evict_blocks({block + 1 for block in blocks})

    def step(self):
        """The step computes what was scheduled: in-flight tokens done, then the next step starts."""
        for request, tokens in self.in_flight:
            request.num_in_flight_tokens -= tokens
        self.in_flight = []
        self.manager.new_step_starts()
        self.book.completed()

    def check_eviction_order(self, what, before, request_id, first_block):
        """vLLM's free queue is LRU: a block holding a cached hash is evicted for new content (the request's blocks
        from first_block on) only once no block without one is left in the free queue."""
        new = set(self.manager.get_block_ids(request_id)[0][first_block:])
        reused = [block for block, cached in before if cached and block in new]
        free_now = {block for block, _ in self.free_queue()}
        still_free = [block for block, cached in before if not cached and block in free_now]
        if reused and still_free:
            raise Failure(
                f"eviction order at step {self.book.step}: the {what} took cached block(s) {reused} for new content "
                f"while block(s) {still_free}, holding no cached hash, stayed in the free queue"
            )
'''
