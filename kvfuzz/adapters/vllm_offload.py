"""vLLM 0.33's KV offloading to CPU (``vllm.v1.kv_offload``) behind kvfuzz's contract, as a second cache tier.

The adapter drives two real vLLM objects together: the ``KVCacheManager`` of :mod:`kvfuzz.adapters.vllm_v1` (the
GPU block pool, with the scheduler's deferred frees: W = 1) and a ``CPUOffloadingManager`` (the CPU block pool,
with its LRU or ARC cache policy: ``lookup``, ``prepare_load``, ``complete_load``, ``prepare_store``,
``complete_store``, ``on_new_request``, ``on_request_finished``). Between them it plays the scheduler side of vLLM's
``OffloadingConnector`` (``OffloadingConnectorScheduler``) in its CPU configuration: one KV-cache group of full
attention, one GPU block per CPU chunk, every computed block offloaded (``offload_prompt_only`` off) and every load
synchronous (``sync_load_budget_bytes`` set, so a hit is loaded before the step that needs it). kvfuzz plays the
worker (``OffloadingConnectorWorker``): it copies what the jobs order between its device and host pools.

Driven as a second cache tier, not as swap (``host_cache``): the CPU tier holds full blocks keyed by their hash, so
it shares them between requests and never holds a partial block, which kvfuzz's swap (every block of one sequence
to host blocks no other sequence holds) cannot express. The mapping:

* ``admit``: ``get_computed_blocks`` (the GPU hit), then ``get_num_new_matched_tokens``: ``lookup`` of the offload
  keys past the GPU hit, a maximal run of ``HIT`` (capped so one prompt token is left to compute); then
  ``allocate_slots`` with the external tokens and, once it succeeds, ``update_state_after_alloc``: ``prepare_load``
  of the hit keys into the blocks after the GPU hit, returned as ``AdmitResult.loads`` (CPU chunk, kvfuzz block).
  The load job is submitted at the next step launch, and its ``complete_load`` comes when that step completes.
* each step launch (``take_transfers``): ``build_connector_meta``: ``prepare_store`` of every scheduled or finished
  request's computed full blocks not yet offered, one store job each, returned as stores (kvfuzz block, CPU chunk)
  and completed (``complete_store``) when that step completes, as the worker reports it; and ``jobs_to_flush``:
  the store jobs of requests preempted since the last launch, and of finished requests whose blocks were handed
  out again since, returned as flushed (vLLM's worker waits for them before the step's forward pass).
  ``on_request_finished`` follows a finished request's last stores.
* ``step_completed``: ``update_connector_output`` with the jobs submitted at that step's launch, then the GPU side.

Deviations, each a lost hit, never a false one: where vLLM would defer a request (a ``HIT_PENDING`` key, or a
request readmitted with transfers still in flight) the adapter admits it without an external hit, since kvfuzz's
``admit`` cannot wait; and an external hit stops one token short of the prompt, where vLLM would load the whole
prompt asynchronously and recompute the last token. The connector's own scheduler class is not run (it needs a
full ``VllmConfig`` and ``SchedulerOutput``): its bookkeeping above is the adapter's, read from vLLM 0.33's source,
so kvfuzz tests the CPU offloading manager and its lifetimes against the GPU pool, not that class's code.
The CPU tier's free set (``host_free_blocks``) is read from the manager: chunks never allocated, its free list, and
the cached chunks no transfer uses (``ref_cnt`` 0, what its policy may evict), so kvfuzz checks the CPU pool as it
checks the GPU pool.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Collection

import attrs

from kvfuzz.adapters.vllm_v1 import VllmOptions, VllmV1Allocator
from kvfuzz.allocator.errors import InvalidArgument
from kvfuzz.allocator.types import AdmitResult, GrowResult, HostTransfers, PoolSpec, SeqId, Tokens

CODE_UNDER_TEST = ("vllm", ("v1/kv_offload", "v1/core"))
"""What a campaign's --coverage measures of this adapter's allocator: vLLM's offloading manager and its CPU backend,
and the V1 KV cache manager its allocator drives beneath them (kvfuzz.coverage.scope)."""


def _import_offloading() -> types.SimpleNamespace:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return types.SimpleNamespace(
        LookupResult=LookupResult,
        ReqContext=ReqContext,
        ScheduleEndContext=ScheduleEndContext,
        make_offload_key=make_offload_key,
        CPUOffloadingManager=CPUOffloadingManager,
    )


@attrs.define
class _RequestState:
    """One request's offloading state, as the connector's ``RequestOffloadState`` keeps it.

    Invariant kept: ``jobs`` lists exactly this request's transfer jobs not yet reported complete; the state lives
    from the request's first admission until it has finished and its last job completed (a preempted request that
    never comes back keeps it, as vLLM keeps a waiting request's).
    """

    request: Any  # the vLLM Request
    context: Any  # its ReqContext, which the CPU manager keeps per-request state in
    block_ids: list[int] = attrs.field(factory=list)  # vLLM ids of its GPU blocks, as last scheduled
    next_stored: int = 0  # first block not yet offered to prepare_store
    jobs: set[int] = attrs.field(factory=set)  # its transfer jobs in flight
    finished: bool = False  # freed: its last stores go out at the next launch, then on_request_finished
    signaled: bool = False  # on_request_finished has been called


@attrs.frozen(eq=False)
class _Job:
    """One transfer job: a load ((CPU chunk, vLLM block) pairs) or a store ((vLLM block, CPU chunk) pairs)."""

    state: _RequestState  # the request it belongs to
    keys: tuple[bytes, ...]  # the offload keys it pins (load) or makes ready (store)
    is_store: bool  # store (GPU -> CPU) or load (CPU -> GPU)
    pairs: tuple[tuple[int, int], ...]  # (source, destination), vLLM block ids on the GPU side


class VllmOffloadAllocator(VllmV1Allocator):
    """vLLM's KV-cache manager with a CPU tier of ``spec.num_host_blocks`` chunks (see the module docstring)."""

    def __init__(self, spec: PoolSpec, cache_policy: str = "lru", asynchronous_loads: bool = False) -> None:
        super().__init__(spec, VllmOptions(inflight_window=1))
        self._off = _import_offloading()
        self.num_host_blocks = spec.num_host_blocks
        self._asynchronous_loads = asynchronous_loads  # no sync-load budget: every external hit loads asynchronously
        # The connector's fence holds a finished request's blocks until its stores are done, so vLLM's free queue
        # takes them in the order the fences lift, not the order kvfuzz freed the requests, and a hit may come from
        # the CPU tier instead of the device cache: neither policy of the device cache (LRU order, complete caching)
        # is declared for the pair.
        self.capabilities = attrs.evolve(
            self.capabilities,
            host_cache=True,
            async_loads=asynchronous_loads,
            eviction_order=None,
            complete_caching=False,
        )
        self._cpu = self._off.CPUOffloadingManager(num_chunks=spec.num_host_blocks, cache_policy=cache_policy)
        self._states: dict[SeqId, _RequestState] = {}  # running or preempted requests
        self._finished: list[_RequestState] = []  # freed requests until signaled finished with no job in flight
        self._jobs: dict[int, _Job] = {}  # job id -> job, until reported complete
        self._next_job = 0  # the next job id
        self._unsubmitted: list[int] = []  # synchronous load jobs ordered since the last launch
        self._async_jobs: dict[SeqId, int] = {}  # request -> its asynchronous load job, until reported landed
        self._flushed: set[int] = set()  # store jobs flushed already: the worker's wait on them again returns at once
        self._submitted: dict[int, list[int]] = {}  # step -> the jobs submitted at its launch
        self._fenced: dict[int, set[int]] = {}  # vLLM block of a finished request -> its store jobs in flight
        self._allocated: set[int] = set()  # vLLM blocks handed to requests since the last launch
        self._scheduled_states: list[_RequestState] = []  # requests given tokens to compute since the last launch
        self._new_ids: list[SeqId] = []  # requests first scheduled since the last launch
        self._preempted_states: list[_RequestState] = []  # requests preempted since the last launch
        self._aborting = False  # free() is releasing a request whose tokens were scheduled this round

    # -- the contract --------------------------------------------------------------------------------------------

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        result = super().grow(seq, tokens)
        self._scheduled_blocks(seq)
        return result

    def free(self, seq: SeqId) -> None:
        state = self._states.get(seq)
        self._aborting = state is not None and any(state is other for other in self._scheduled_states)
        try:
            super().free(seq)
        finally:
            self._aborting = False
        state = self._states.pop(seq)
        state.finished = True
        self._finished.append(state)
        # request_finished: its blocks with stores in flight are fenced, so handing one out again flushes them.
        for job_id in state.jobs:
            self._fence(job_id)

    def _release(self, request: Any) -> None:
        """The scheduler's deferred free, fenced as vLLM fences it (``sched_step_seq``): a request aborted in the
        round its tokens were scheduled keeps its blocks until the step running them completes, one step past W."""
        if not self._aborting:
            super()._release(request)
            return
        fence = self._last_completed + self._inflight_window + 1
        self._deferred.defer(fence, self._manager.pop_blocks_for_free(request))

    def preempt(self, seq: SeqId) -> None:
        super().preempt(seq)
        self._preempted_states.append(self._states[seq])

    def host_free_blocks(self) -> Collection[int]:
        """CPU chunks no transfer uses: never allocated yet, on the manager's free list, or cached with ``ref_cnt`` 0
        (what its policy may evict); a chunk whose store is in flight (``ref_cnt`` -1) or a load reads is not."""
        cpu = self._cpu
        policy = cpu._policy
        cached = policy.chunks.values() if hasattr(policy, "chunks") else [*policy.t1.values(), *policy.t2.values()]
        unused = [chunk.chunk_id for chunk in cached if chunk.ref_cnt == 0]
        return [*range(cpu._num_allocated_chunks, cpu._num_chunks), *cpu._free_list, *unused]

    def take_transfers(self, step: int) -> HostTransfers:
        """``build_connector_meta`` for the step being launched, then the worker's submission of its jobs."""
        flush = {job_id for state in self._preempted_states for job_id in state.jobs}
        flush |= {job_id for block in self._allocated for job_id in self._fenced.get(block, ())}
        stores = self._store_jobs(flush)
        # A request freed after it was scheduled this round was aborted after vLLM's schedule(): it signals its end
        # at the next launch.
        finishing = [state for state in self._finished if not any(state is other for other in self._scheduled_states)]
        # A sync load in the flush list has landed already (the worker waited for it in its own step).
        flush = {job_id for job_id in flush - self._flushed if self._jobs[job_id].is_store}
        self._flushed |= flush
        for state in finishing:
            if not state.signaled:
                state.signaled = True
                self._cpu.on_request_finished(state.context)
        self._finished = [state for state in self._finished if state.jobs or not state.signaled]
        self._cpu.on_schedule_end(
            self._off.ScheduleEndContext(self._new_ids, [state.context.req_id for state in self._preempted_states])
        )
        submitted = self._unsubmitted + stores
        if submitted:
            self._submitted[step] = submitted
        self._unsubmitted, self._allocated, self._new_ids, self._preempted_states = [], set(), [], []
        self._scheduled_states = []
        return HostTransfers(
            stores=[self._kvfuzz_pair(job_id, pair) for job_id in stores for pair in self._jobs[job_id].pairs],
            flushed=[self._kvfuzz_pair(job_id, pair) for job_id in sorted(flush) for pair in self._jobs[job_id].pairs],
        )

    def loads_landed(self, seq: SeqId) -> None:
        """``update_connector_output`` with the request's asynchronous load job among the worker's completed jobs
        (``complete_load``), then the scheduler's side (:meth:`VllmV1Allocator.loads_landed`)."""
        job_id = self._async_jobs.pop(seq, None)
        if job_id is None:
            raise InvalidArgument(f"loads_landed: sequence {seq!r} has no asynchronous load in flight")
        self._complete(job_id)
        super().loads_landed(seq)

    def resume(self, seq: SeqId) -> AdmitResult:
        """The scheduler's ``resume``, then the scheduler output's new blocks for the request, as at admission."""
        result = super().resume(seq)
        self._scheduled_blocks(seq)
        return result

    def step_completed(self, step: int) -> None:
        """``update_connector_output``: the worker reports the jobs submitted at this step's launch as done."""
        if step > self._last_completed:
            for job_id in self._submitted.pop(step, ()):
                self._complete(job_id)
        super().step_completed(step)

    # -- the connector's part in admission -----------------------------------------------------------------------

    def _external_hit(self, seq: SeqId, request: Any, num_local: int) -> tuple[int, bool]:
        state = self._states.get(seq)
        if state is None:
            context = self._off.ReqContext(req_id=seq)
            self._cpu.on_new_request(context)
            state = self._states[seq] = _RequestState(request, context)
        state.block_ids, state.next_stored = [], 0
        if state.jobs:
            return 0, False  # vLLM delays a request with transfers in flight; kvfuzz's admit cannot wait
        size = self.block_size
        hit = 0
        for index in range(num_local // size, min(len(request.block_hashes), (request.num_tokens - 1) // size)):
            found = self._cpu.lookup(self._key(state, index), state.context)
            if found is self._off.LookupResult.HIT_PENDING:
                return 0, False  # vLLM defers the request until the pending store completes
            if found is not self._off.LookupResult.HIT:
                break
            hit += 1
        return hit * size, self._asynchronous_loads and hit > 0

    def _external_loads(
        self, seq: SeqId, request: Any, num_local: int, num_external: int
    ) -> tuple[tuple[int, int], ...]:
        state = self._states[seq]
        self._new_ids.append(seq)
        self._scheduled_blocks(seq)
        size = self.block_size
        first, end = num_local // size, (num_local + num_external) // size
        state.next_stored = end  # CHUNK_LEVEL: the loaded chunks are not offered to the store again
        if not num_external:
            return ()
        keys = tuple(self._key(state, index) for index in range(first, end))
        chunks = self._cpu.prepare_load(keys, state.context).block_ids.tolist()
        pairs = tuple(zip(chunks, state.block_ids[first:end]))
        job_id = self._new_job(_Job(state, keys, False, pairs))
        if self._asynchronous_loads:
            self._async_jobs[seq] = job_id  # complete when kvfuzz, as the worker, reports it (loads_landed)
        else:
            self._unsubmitted.append(job_id)
        return tuple((chunk, block - 1) for chunk, block in pairs)

    # -- helpers -------------------------------------------------------------------------------------------------

    def _key(self, state: _RequestState, index: int) -> bytes:
        """The offload key of a request's block ``index``, its position recorded as ``update_offload_keys`` does."""
        key: bytes = self._off.make_offload_key(state.request.block_hashes[index], 0)
        state.context.set_offload_key_position(key, (index + 1) * self.block_size)
        return key

    def _scheduled_blocks(self, seq: SeqId) -> None:
        """The scheduler output's block ids for ``seq``: its new blocks (every block, at admission) count as
        allocated this round."""
        (blocks,) = self._manager.get_blocks(seq).get_block_ids()
        state = self._states[seq]
        self._allocated.update(blocks[len(state.block_ids) :])
        state.block_ids = list(blocks)
        self._scheduled_states.append(state)

    def _store_jobs(self, flush: set[int]) -> list[int]:
        """``_build_store_jobs``: one store job per request with computed full blocks not yet offered."""
        size = self.block_size
        jobs = []
        scheduled = [state for seq, state in self._states.items() if seq in self._running]  # not the preempted
        for state in scheduled + [state for state in self._finished if not state.signaled]:
            request = state.request
            end = min(request.num_computed_tokens // size, len(state.block_ids), len(request.block_hashes))
            keys = [self._key(state, index) for index in range(state.next_stored, end)]
            if not keys:
                continue
            output = self._cpu.prepare_store(keys, state.context)
            if output is None:
                continue  # no room in the CPU tier: offered again at the next launch
            state.next_stored = max(state.next_stored, end)
            if not output.keys_to_store:
                continue
            index_of = {key: index for index, key in enumerate(keys, start=end - len(keys))}
            sources = [state.block_ids[index_of[key]] for key in output.keys_to_store]
            pairs = tuple(zip(sources, output.store_spec.block_ids.tolist()))
            job_id = self._new_job(_Job(state, tuple(output.keys_to_store), True, pairs))
            jobs.append(job_id)
            if state.finished:
                self._fence(job_id)
                scheduled_now = any(state is other for other in self._scheduled_states)
                if not scheduled_now and self._allocated.intersection(sources):
                    flush.add(job_id)
        return jobs

    def _new_job(self, job: _Job) -> int:
        job_id = self._next_job
        self._next_job += 1
        self._jobs[job_id] = job
        job.state.jobs.add(job_id)
        return job_id

    def _fence(self, job_id: int) -> None:
        job = self._jobs[job_id]
        if job.is_store:
            for block, _ in job.pairs:
                self._fenced.setdefault(block, set()).add(job_id)

    def _complete(self, job_id: int) -> None:
        job = self._jobs.pop(job_id)
        self._flushed.discard(job_id)
        state = job.state
        if job.is_store:
            self._cpu.complete_store(job.keys, state.context)
            for block, _ in job.pairs:
                fenced = self._fenced.get(block)
                if fenced is not None:
                    fenced.discard(job_id)
                    if not fenced:
                        del self._fenced[block]
        else:
            self._cpu.complete_load(job.keys, state.context)
        state.jobs.discard(job_id)
        if state.signaled and not state.jobs:
            self._finished.remove(state)

    def _kvfuzz_pair(self, job_id: int, pair: tuple[int, int]) -> tuple[int, int]:
        """A store's (vLLM block, CPU chunk) as (kvfuzz block, host block)."""
        block, chunk = pair
        return block - 1, chunk


def _factory(name: str, doc: str, **options: Any) -> Callable[[PoolSpec], VllmOffloadAllocator]:
    def factory(spec: PoolSpec) -> VllmOffloadAllocator:
        return VllmOffloadAllocator(spec, **options)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = doc
    return factory


cpu_offloading = _factory(
    "cpu_offloading",
    "vLLM's KV-cache manager (deferred frees, W = 1) with a CPU tier of num_host_blocks chunks under LRU.",
)
cpu_offloading_async_loads = _factory(
    "cpu_offloading_async_loads",
    "As cpu_offloading, without a sync-load budget: every CPU hit loads asynchronously, the request waiting "
    "(WAITING_FOR_REMOTE_KVS) until kvfuzz reports its loads landed (async_loads).",
    asynchronous_loads=True,
)
cpu_offloading_arc = _factory(
    "cpu_offloading_arc", "As cpu_offloading, with the CPU tier under the ARC cache policy.", cache_policy="arc"
)
