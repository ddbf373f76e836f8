"""vLLM v1's KV-cache manager (``vllm.v1.core.kv_cache_manager.KVCacheManager``, vllm 0.33.0) behind kvfuzz's contract.

The adapter is a scheduler shim: it drives one real ``KVCacheManager`` (with its real ``BlockPool``, free queue and
prefix-cache hash map) exactly the way vLLM's v1 ``Scheduler`` does, with real ``vllm.v1.request.Request`` objects
whose block hashes come from vLLM's own request block hasher (sha256, the engine default).

Mapping of the contract onto the scheduler's calls:

* ``admit``: ``get_computed_blocks`` (the prefix hit, capped at ``num_tokens - 1`` by vLLM), then ``allocate_slots``
  for the rest of the prompt; ``allocate_slots`` returning ``None`` is :class:`OutOfBlocks`. A preempted sequence is
  re-admitted with its own ``Request`` object, as the scheduler resumes it.
* ``grow``: the tokens are appended to the request (as ``update_from_output`` appends sampled tokens), then
  ``allocate_slots`` for them; on a refusal the adapter takes its own append back, so the request is as before.
* ``free``: ``KVCacheManager.free`` (finish or abort); ``preempt``: the same, then the request is reset as
  ``Scheduler._preempt_request`` resets it.
* ``reset_cache``: ``reset_prefix_cache`` when no block is in use (its own precondition); otherwise ``evict_blocks``
  over every cached, unreferenced block. ``evict(n)``: ``evict_blocks`` over the first ``n`` cached blocks of the
  free queue, the ones vLLM would evict first. ``evict_blocks`` (targeted eviction, declared by the ``_kv_connector``
  factory): ``KVCacheManager.evict_blocks`` over the named blocks, as a KV connector reports invalid blocks and an
  offloading connector drops evicted ones; vLLM drops their hashes and leaves them where they are in the free queue
  (which breaks its LRU order: ``corpus/vllm-v1-kv-cache-manager-kv-connector-eviction-order-*.json``).
* ``step_completed``: the scheduler's bookkeeping of finished steps (in-flight tokens, deferred frees).

After each scheduled operation the request's ``num_computed_tokens`` counts the scheduled tokens, as
``Scheduler._update_after_schedule`` does, and ``num_in_flight_tokens`` counts them until the step that computes them
completes.

The pool: vLLM reserves physical block 0 as its null block, so the manager is built with ``spec.num_blocks + 1``
physical blocks and kvfuzz block ``b`` is vLLM block ``b + 1``. The null block never appears as a kvfuzz block: in a
block table (a sliding-window drop) it is :data:`~kvfuzz.allocator.types.NULL_BLOCK`.

Namespaces map injectively onto vLLM's extra hash keys: the JSON encoding of the namespace's parts becomes the
request's ``cache_salt`` (or the name of a LoRA adapter, for the LoRA variant); the empty namespace sets neither.

In-flight window W = 1 emulates the scheduler with a KV-consumer connector and two batches in flight, where
``Scheduler.defer_block_free`` holds a released request's blocks (``pop_blocks_for_free``) until every step
scheduled so far has been processed, then returns them with ``BlockPool.free_blocks``. In kvfuzz's clock that
fence is ``last completed step + W``. Without a connector vLLM frees at once and relies on the GPU stream to order
a reused block's writes after the old ones: that engine is W = 0.

Speculative decoding (the ``_spec_decode`` factories), as the scheduler runs it with ``num_speculative_tokens`` = k
and ``num_lookahead_tokens`` = L: of a ``grow`` of n tokens the first ``n - min(n - 1, k)`` join the request's
tokens (the token the previous step sampled, and any known tokens before the drafts) and the last ``min(n - 1, k)``
are its ``spec_token_ids``, the drafts; ``allocate_slots`` schedules all n with ``num_lookahead_tokens=L``, so the
table reaches ``ceil((len + L) / block_size)`` blocks, and caches only up to the request's own tokens, never a draft.
``rollback`` is the rejection in ``update_from_output``: it drops drafts and lowers ``num_computed_tokens``, and the
blocks stay. The drafts left are accepted when the request next grows, is freed or preempted: they join its tokens,
and what is computed is cached as ``update_from_output`` caches it. Rollback drops at most the drafts of the latest
grow, so the length never falls more than k below the longest it has been, and a table holds at most
``ceil((k + L) / block_size)`` blocks beyond its tokens: declared as ``speculative_tokens`` = k and
``lookahead_blocks``. (vLLM adds accepted drafts when the step's output is processed; the adapter learns which were
accepted only when kvfuzz rolls the others back, so a hit on them is possible one operation later than in vLLM: a
lost hit, never a false one.)

Not supported: fork (vLLM v1 shares only through the prefix cache), swap (v1 preempts by recomputation), rollback
outside the speculative-decoding factories (only rejected drafts are ever dropped, and those factories model them).
Partial-block hits (``hash_block_size < block_size``) are not driven: their copy-on-write copy is ordered at
admission, which kvfuzz's ``admit`` cannot express.

Two behaviours of ``allocate_slots`` the adapter declares, both vLLM's design rather than the adapter's: it makes
full blocks matchable when their tokens are scheduled, before the step writes them (``hits_scheduled_writes`` and
the two that follow); and with a sliding window it drops out-of-window blocks before it checks for room, so a
refused grow can still release them (``refusal_drops_window``).
"""

from __future__ import annotations

import importlib.util
from collections import deque
from typing import Any, Callable, Optional, Sequence

from kvfuzz.adapters.base import SequenceLedger
from kvfuzz.adapters.vllm_scheduler import (
    MAX_MODEL_LEN,
    UNTIL_LOADS_LAND,
    DeferredFrees,
    InFlight,
    NamespaceKeys,
    VllmOptions,
    import_vllm,
)
from kvfuzz.allocator.errors import InvalidArgument, OutOfBlocks, Unsupported
from kvfuzz.allocator.types import (
    NULL_BLOCK,
    AdmitResult,
    Capabilities,
    EvictionOrder,
    GrowResult,
    Namespace,
    PoolSpec,
    SeqId,
    Slot,
    Tokens,
)

CODE_UNDER_TEST = ("vllm", ("v1/core",))
"""What a campaign's --coverage measures of this adapter's allocator: vLLM's V1 KV cache manager, its coordinator,
block pool and single-type managers (kvfuzz.coverage.scope)."""

if importlib.util.find_spec("vllm") is None:
    # Fail at import, so that a trace naming this adapter is skipped where vLLM is not installed.
    raise ImportError(
        "kvfuzz.adapters.vllm_v1 needs vllm 0.33.0; build an environment with scripts/third_party_env.sh vllm"
    )


class VllmV1Allocator:
    """One vLLM ``KVCacheManager`` driven as vLLM's v1 scheduler drives it (see the module docstring)."""

    def __init__(self, spec: PoolSpec, options: VllmOptions = VllmOptions()) -> None:
        self._vllm = vllm = import_vllm()
        self.block_size = spec.block_size
        self.num_blocks = spec.num_blocks
        self.num_host_blocks = 0
        speculative = options.speculative_tokens
        if options.lookahead_tokens and not speculative:
            raise ValueError("VllmOptions: lookahead_tokens without speculative_tokens")
        # allocate_slots registers full blocks in the prefix cache when their tokens are scheduled. vLLM v1 shares
        # blocks between requests only through the prefix cache (no fork) and preempts by recomputation, with no
        # host pool (no swap).
        self.capabilities = Capabilities(
            prefix_cache=options.prefix_caching,
            namespaces=options.prefix_caching,
            eviction=options.prefix_caching,
            targeted_eviction=options.prefix_caching and options.kv_connector,
            eviction_order=EvictionOrder.LRU if options.prefix_caching and options.sliding_window is None else None,
            complete_caching=options.prefix_caching and options.sliding_window is None,
            inflight_window=options.inflight_window,
            sliding_window=options.sliding_window,
            refusal_drops_window=options.sliding_window is not None,
            introspection=True,
            hits_scheduled_writes=True,
            shares_scheduled_blocks=True,
            free_lands_scheduled_writes=True,
            preempt_scheduled=options.priority_policy,
            rollback=speculative > 0,
            speculative_tokens=speculative or None,
            lookahead_blocks=-(-(speculative + options.lookahead_tokens) // spec.block_size),
        )
        self._manager = vllm.KVCacheManager(
            vllm.KVCacheConfig(
                num_blocks=spec.num_blocks + 1,
                kv_cache_tensors=[],
                kv_cache_groups=self._kv_cache_groups(options),
            ),
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=self._scheduler_block_size(),
            hash_block_size=spec.block_size,
            enable_caching=options.prefix_caching,
        )
        self._pool = self._manager.block_pool
        if self._pool.null_block.block_id - 1 != NULL_BLOCK:  # what block tables and the free queue are read by
            raise RuntimeError(f"vLLM's null block is block {self._pool.null_block.block_id}, not 0")
        self._hasher = None
        if options.prefix_caching:
            vllm.init_none_hash(vllm.sha256)
            self._hasher = vllm.get_request_block_hasher(spec.block_size, vllm.sha256)
        self._sampling = vllm.SamplingParams(max_tokens=MAX_MODEL_LEN)
        self._keys = NamespaceKeys(options.namespace_key, vllm.LoRARequest)
        self._inflight_window = options.inflight_window
        self.sequences = SequenceLedger()  # the requests held and their phases; raises the misuse errors
        self._speculative_tokens = speculative  # drafts carried by each grow (0: no speculative decoding)
        self._lookahead_tokens = options.lookahead_tokens  # slots allocated ahead of the tokens, for the drafter
        self._running: dict[SeqId, Any] = {}  # running request -> its vLLM Request
        self._preempted: dict[SeqId, Any] = {}  # preempted request -> its Request, reset as the scheduler resets it
        self._loading: dict[SeqId, Any] = {}  # request waiting for its asynchronous loads -> its Request
        self._landed: dict[SeqId, Any] = {}  # request whose loads landed, waiting to be scheduled -> its Request
        # Request freed while loading -> its blocks, held by a deferred free until its loads are reported landed.
        self._orphans: dict[SeqId, list[Any]] = {}
        self._deferred = DeferredFrees()
        self._in_flight: deque[InFlight] = deque()
        self._last_completed = -1

    def _kv_cache_groups(self, options: VllmOptions) -> list[Any]:
        """The ``KVCacheGroupSpec`` list the manager is built over: one group here (full attention, or a sliding
        window), so vLLM picks its ``UnitaryKVCacheCoordinator`` (or, without prefix caching, its
        ``KVCacheCoordinatorNoPrefixCache``)."""
        return [self._vllm.KVCacheGroupSpec(["kvfuzz.attn"], self._kv_spec(options.sliding_window))]

    def _scheduler_block_size(self) -> int:
        """vLLM's ``scheduler_block_size``, the unit its hits are aligned to: the block size of the one group here."""
        return self.block_size

    def _kv_spec(self, sliding_window: Optional[int], block_size: Optional[int] = None) -> Any:
        """A full-attention spec, or a sliding-window one of ``sliding_window`` tokens, of one KV head of size 1, with
        blocks of ``block_size`` tokens (the pool's when None)."""
        vllm = self._vllm
        size = self.block_size if block_size is None else block_size
        shape = dict(block_size=size, num_kv_heads=1, head_size=1, dtype=vllm.torch.float32)
        if sliding_window is None:
            return vllm.FullAttentionSpec(**shape)
        return vllm.SlidingWindowSpec(**shape, sliding_window=sliding_window)

    # -- the contract --------------------------------------------------------------------------------------------

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        self.sequences.check_admit(seq, tokens)
        request = self._preempted.get(seq)
        if request is None:
            request = self._vllm.Request(
                request_id=seq,
                prompt_token_ids=list(tokens),
                sampling_params=self._sampling,
                pooling_params=None,
                block_hasher=self._hasher,
                **self._keys.request_kwargs(namespace),
            )
        elif tuple(request.all_token_ids) != tuple(tokens):
            raise InvalidArgument(f"admit: preempted sequence {seq!r} comes back with other tokens than it had")
        hit, num_hit, _ = self._manager.get_computed_blocks(request)
        num_external, load_async = self._external_hit(seq, request, num_hit)
        if load_async:
            return self._admit_loading(seq, request, hit, num_hit, num_external)
        num_new = request.num_tokens - num_hit - num_external
        if (
            self._manager.allocate_slots(
                request,
                num_new,
                num_new_computed_tokens=num_hit,
                new_computed_blocks=hit,
                num_lookahead_tokens=self._lookahead_tokens,
                num_external_computed_tokens=num_external,
            )
            is None
        ):
            raise self._refusal(f"admit of {seq!r} ({len(tokens)} tokens, {num_hit} cached, {num_external} external)")
        self._check_no_copies("admit")
        self._preempted.pop(seq, None)
        request.status = self._vllm.RequestStatus.RUNNING
        request.num_computed_tokens = num_hit + num_external
        self._scheduled(request, num_new)
        self._running[seq] = request
        self.sequences.admitted(seq)
        loads = self._external_loads(seq, request, num_hit, num_external)
        return AdmitResult(self.block_table(seq), num_hit + num_external, loads)

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        request = self._request(seq, "grow")
        self.sequences.check_tokens("grow", seq, tokens)
        old_len, old_verified, accepted = request.num_tokens_with_spec, request.num_tokens, request.spec_token_ids
        num_drafts = min(len(tokens) - 1, self._speculative_tokens)
        # update_from_output: the drafts not rejected, then the sampled token, join the request's tokens; then the
        # scheduler proposes the new drafts.
        request.spec_token_ids = []
        request.append_output_token_ids([*accepted, *tokens[: len(tokens) - num_drafts]])
        request.spec_token_ids = list(tokens[len(tokens) - num_drafts :])
        if self._manager.allocate_slots(request, len(tokens), num_lookahead_tokens=self._lookahead_tokens) is None:
            self._take_back_tokens(request, old_verified)
            request.spec_token_ids = accepted
            raise self._refusal(f"grow of {seq!r} by {len(tokens)} token(s)")
        self._check_no_copies("grow")
        self._scheduled(request, len(tokens))
        table, size = self.block_table(seq), self.block_size
        return GrowResult([Slot(table[p // size], p % size) for p in range(old_len, request.num_tokens_with_spec)])

    def free(self, seq: SeqId) -> None:
        if seq in self._loading or seq in self._landed:
            self._free_waiting(seq)
            return
        request = self._request(seq, "free")
        self._accept_drafts(request)
        del self._running[seq]
        request.status = self._vllm.RequestStatus.FINISHED_ABORTED
        self._release(request)
        self.sequences.freed(seq)

    def preempt(self, seq: SeqId) -> None:
        request = self._request(seq, "preempt")
        self._accept_drafts(request)
        del self._running[seq]
        self._release(request)
        request.status = self._vllm.RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._preempted[seq] = request
        self.sequences.preempted(seq)

    def rollback(self, seq: SeqId, num_tokens: int) -> None:
        if not self._speculative_tokens:
            raise Unsupported("rollback: vLLM drops only rejected drafts, and this factory has no speculative decoding")
        request = self._request(seq, "rollback")
        drafts = request.spec_token_ids
        if not 1 <= num_tokens <= len(drafts):
            raise InvalidArgument(
                f"rollback: {seq!r} has {len(drafts)} draft(s) awaiting verification, cannot reject {num_tokens}"
            )
        # update_from_output's rejection: the drafts go, num_computed_tokens falls back, the blocks stay.
        request.spec_token_ids = drafts[: len(drafts) - num_tokens]
        request.num_computed_tokens -= num_tokens

    def evict(self, num_blocks: int) -> int:
        if num_blocks < 0:
            raise InvalidArgument(f"evict: cannot evict {num_blocks} blocks")
        victims = [block.block_id for block in self._free_queue() if block.block_hash is not None][:num_blocks]
        if victims:
            self._manager.evict_blocks(set(victims))
        return len(victims)

    def reset_cache(self) -> None:
        if self._pool.get_num_free_blocks() == self.num_blocks:
            if not self._manager.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache with every block free")
            return
        cached = {block.block_id for block in self._free_queue() if block.block_hash is not None}
        if cached:
            self._manager.evict_blocks(cached)

    def evict_blocks(self, blocks: Sequence[int]) -> None:
        bad = [block for block in blocks if not 0 <= block < self.num_blocks]
        if bad:
            raise InvalidArgument(f"evict_blocks: block(s) {bad} outside the pool")
        self._manager.evict_blocks({block + 1 for block in blocks})

    def loads_landed(self, seq: SeqId) -> None:
        """``_update_from_kv_xfer_finished`` with ``seq`` among the worker's ``finished_recving``, then the next
        schedule's ``_update_waiting_for_remote_kv``: a waiting request caches the blocks its loads filled
        (``cache_blocks``, delayed since its admission) and waits to be scheduled; one finished meanwhile has its
        blocks freed now (``_free_blocks``), through the deferred frees."""
        orphan = self._orphans.pop(seq, None)
        if orphan is not None:
            self._deferred.refence(orphan, self._last_completed + self._inflight_window)
            self._deferred.drain(self._last_completed, self._pool.free_blocks)
            return
        request = self._loading.pop(seq, None)
        if request is None:
            raise InvalidArgument(f"loads_landed: sequence {seq!r} has no loads in flight")
        self._manager.cache_blocks(request, request.num_computed_tokens)
        request.status = (
            self._vllm.RequestStatus.PREEMPTED if request.num_preemptions else self._vllm.RequestStatus.WAITING
        )
        self._landed[seq] = request

    def resume(self, seq: SeqId) -> AdmitResult:
        """The scheduler picks a request whose loads landed: ``allocate_slots`` for the rest of its prompt (no new
        hit: its computed tokens are those loaded), then it runs as a newly scheduled request."""
        request = self._landed.get(seq)
        if request is None:
            raise InvalidArgument(f"resume: sequence {seq!r} has no landed loads")
        num_cached = request.num_computed_tokens
        num_new = request.num_tokens - num_cached
        if self._manager.allocate_slots(request, num_new, num_lookahead_tokens=self._lookahead_tokens) is None:
            raise self._refusal(f"resume of {seq!r} ({num_new} tokens past its {num_cached} loaded)")
        self._check_no_copies("resume")
        del self._landed[seq]
        request.status = self._vllm.RequestStatus.RUNNING
        self._scheduled(request, num_new)
        self._running[seq] = request
        self.sequences.admitted(seq)
        return AdmitResult(self.block_table(seq), num_cached)

    def step_completed(self, step: int) -> None:
        if step <= self._last_completed:
            raise InvalidArgument(f"step_completed({step}) after step {self._last_completed} completed")
        self._last_completed = step
        self._deferred.drain(step, self._pool.free_blocks)
        while self._in_flight and self._in_flight[0].done_after <= step:
            done = self._in_flight.popleft()
            done.request.num_in_flight_tokens -= done.tokens
        self._manager.new_step_starts()

    def library_block_name(self, block: int) -> str:
        """Block ``block`` as vLLM numbers it (past its null block 0), for ``kvfuzz show``."""
        return f"vLLM block {block + 1}"

    def block_table(self, seq: SeqId) -> tuple[int, ...]:
        """The table of the manager's first KV-cache group (its only one here)."""
        return self._group_tables(seq, "block_table")[0]

    # -- introspection -------------------------------------------------------------------------------------------

    def refcount(self, block: int) -> int:
        """vLLM's ``ref_cnt`` less the references a deferred free still holds (those are pending, not live)."""
        return self._pool.blocks[block + 1].ref_cnt - self._deferred.holds[block + 1]

    def free_blocks(self) -> list[int]:
        """The free queue's blocks that hold no cached hash, in queue order. Each is ``block_id - 1`` (vLLM's null
        block is its block 0, so that is :data:`NULL_BLOCK` for it too), computed inline: the checks ask for these
        sets several times a call."""
        return [block.block_id - 1 for block in self._free_queue() if block.block_hash is None]

    def cached_blocks(self) -> list[int]:
        """The free queue's blocks that still hold a cached hash (evictable), in eviction order (as free_blocks)."""
        return [block.block_id - 1 for block in self._free_queue() if block.block_hash is not None]

    def pending_blocks(self) -> list[int]:
        """Blocks that only deferred frees still hold."""
        blocks = self._pool.blocks
        return [
            block_id - 1 for block_id, held in self._deferred.holds.items() if held and blocks[block_id].ref_cnt == held
        ]

    # -- a KV connector's part in admission (none here; kvfuzz.adapters.vllm_offload has one) --------------------

    def _external_hit(self, seq: SeqId, request: Any, num_local: int) -> tuple[int, bool]:
        """The connector's ``get_num_new_matched_tokens``: tokens past the local hit it can load (none here), and
        whether it loads them asynchronously."""
        return 0, False

    def _external_loads(
        self, seq: SeqId, request: Any, num_local: int, num_external: int
    ) -> tuple[tuple[int, int], ...]:
        """The connector's ``update_state_after_alloc``: the (host block, kvfuzz block) loads of an admission's
        external hit, once its slots are allocated (none here)."""
        return ()

    # -- the scheduler's side of asynchronous loads (WAITING_FOR_REMOTE_KVS) -------------------------------------

    def _admit_loading(self, seq: SeqId, request: Any, hit: Any, num_hit: int, num_external: int) -> AdmitResult:
        """The scheduler's admission of a request whose external hit loads asynchronously: ``allocate_slots`` for the
        hit alone (no new tokens), its caching delayed until the loads land (``delay_cache_blocks``); the request
        waits (``WAITING_FOR_REMOTE_KVS``) with its hit counted as computed, and computes nothing until resumed."""
        if (
            self._manager.allocate_slots(
                request,
                0,
                num_new_computed_tokens=num_hit,
                new_computed_blocks=hit,
                num_external_computed_tokens=num_external,
                delay_cache_blocks=True,
            )
            is None
        ):
            raise self._refusal(f"admit of {seq!r} ({num_hit} cached, {num_external} to load asynchronously)")
        self._check_no_copies("admit")
        self._preempted.pop(seq, None)
        request.status = self._vllm.RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_hit + num_external
        self._loading[seq] = request
        self.sequences.loading(seq)
        loads = self._external_loads(seq, request, num_hit, num_external)
        return AdmitResult(self.block_table(seq), num_hit + num_external, loads, waits_for_loads=True)

    def _free_waiting(self, seq: SeqId) -> None:
        """``finish_requests`` of a waiting request: one whose loads landed is freed as any other; one still loading
        keeps its blocks (``delay_free_blocks``) until its loads are reported (``loads_landed``)."""
        request = self._loading.pop(seq, None)
        if request is None:
            request = self._landed.pop(seq)
            request.status = self._vllm.RequestStatus.FINISHED_ABORTED
            self._release(request)
        else:
            request.status = self._vllm.RequestStatus.FINISHED_ABORTED
            self._orphans[seq] = self._deferred.defer(UNTIL_LOADS_LAND, self._manager.pop_blocks_for_free(request))
        self.sequences.freed(seq)

    # -- helpers -------------------------------------------------------------------------------------------------

    def _request(self, seq: SeqId, op: str) -> Any:
        """The running request's ``Request`` (``sequences`` raises for any other)."""
        self.sequences.running(seq, op)
        return self._running[seq]

    def _group_tables(self, seq: SeqId, op: str) -> tuple[tuple[int, ...], ...]:
        """The table in each KV-cache group, in the manager's group order, of a running request or one waiting for
        its loads."""
        self.sequences.live(seq, op)
        return tuple(
            tuple(block.block_id - 1 for block in blocks)  # the null block, vLLM's block 0, is NULL_BLOCK
            for blocks in self._manager.get_blocks(seq).blocks
        )

    def _scheduled(self, request: Any, num_tokens: int) -> None:
        """The scheduler's ``_update_after_schedule``: the tokens count as computed and in flight until the step
        that computes them (the next one launched) has completed."""
        request.num_computed_tokens += num_tokens
        request.num_in_flight_tokens += num_tokens
        self._in_flight.append(InFlight(self._last_completed + self._inflight_window + 1, request, num_tokens))

    def _accept_drafts(self, request: Any) -> None:
        """The drafts left of the latest grow were accepted: as ``update_from_output`` does, they join the request's
        tokens, and what is computed (not in flight) is cached."""
        accepted = request.spec_token_ids
        if not accepted:
            return
        request.spec_token_ids = []
        request.append_output_token_ids(accepted)
        self._manager.cache_blocks(request, request.num_computed_tokens - request.num_in_flight_tokens)

    def _release(self, request: Any) -> None:
        if self._inflight_window == 0:
            self._manager.free(request)
        else:
            self._deferred.defer(
                self._last_completed + self._inflight_window, self._manager.pop_blocks_for_free(request)
            )

    def _take_back_tokens(self, request: Any, num_tokens: int) -> None:
        """Undo the adapter's own append of refused tokens: token lists and the hashes of blocks they filled."""
        del request._all_token_ids[num_tokens:]
        del request._output_token_ids[max(0, num_tokens - request.num_prompt_tokens) :]
        del request.block_hashes[num_tokens // self.block_size :]

    def _check_no_copies(self, op: str) -> None:
        copies, _ = self._manager.take_kv_cache_block_copies()
        if copies:
            raise RuntimeError(f"{op}: vLLM ordered block copies {copies}, which the adapter cannot hand to kvfuzz")

    def _refusal(self, what: str) -> OutOfBlocks:
        available = self._pool.get_num_free_blocks()
        return OutOfBlocks(
            f"{what}: vLLM's allocate_slots refused with {available} free block(s) in its queue", available=available
        )

    def _free_queue(self) -> list[Any]:
        return self._pool.free_block_queue.get_all_free_blocks()


def _factory(name: str, doc: str, **options: Any) -> Callable[[PoolSpec], VllmV1Allocator]:
    def factory(spec: PoolSpec) -> VllmV1Allocator:
        return VllmV1Allocator(spec, VllmOptions(**options))

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = doc
    return factory


kv_cache_manager = _factory(
    "kv_cache_manager", "Prefix caching, namespaces as cache salts, synchronous engine (W = 0)."
)
kv_cache_manager_priority = _factory(
    "kv_cache_manager_priority",
    "Prefix caching, W = 0, under the priority policy, which may preempt a request "
    "already scheduled in the same round.",
    priority_policy=True,
)
kv_cache_manager_lora = _factory(
    "kv_cache_manager_lora", "Prefix caching, namespaces as LoRA adapters, W = 0.", namespace_key="lora"
)
kv_cache_manager_kv_connector = _factory(
    "kv_cache_manager_kv_connector",
    "Prefix caching, W = 0, with a KV connector that evicts particular blocks by id (targeted eviction).",
    kv_connector=True,
)
kv_cache_manager_deferred_free = _factory(
    "kv_cache_manager_deferred_free",
    "Prefix caching; the scheduler's deferred frees with two batches in flight (W = 1).",
    inflight_window=1,
)
kv_cache_manager_sliding_window = _factory(
    "kv_cache_manager_sliding_window",
    "A sliding-window group of 12 tokens with prefix caching, W = 0.",
    sliding_window=12,
)
kv_cache_manager_no_prefix_cache = _factory(
    "kv_cache_manager_no_prefix_cache", "Prefix caching disabled, W = 0.", prefix_caching=False
)
kv_cache_manager_no_prefix_cache_deferred_free = _factory(
    "kv_cache_manager_no_prefix_cache_deferred_free",
    "Prefix caching disabled; deferred frees (W = 1).",
    prefix_caching=False,
    inflight_window=1,
)
kv_cache_manager_spec_decode = _factory(
    "kv_cache_manager_spec_decode",
    "Prefix caching, W = 0, speculative decoding as with an EAGLE proposer: 3 drafts a step, 3 look-ahead slots.",
    speculative_tokens=3,
    lookahead_tokens=3,
)
kv_cache_manager_ngram_spec_decode = _factory(
    "kv_cache_manager_ngram_spec_decode",
    "Prefix caching, W = 0, speculative decoding as with the n-gram proposer: 3 drafts a step, no look-ahead slots.",
    speculative_tokens=3,
)
kv_cache_manager_spec_decode_deferred_free = _factory(
    "kv_cache_manager_spec_decode_deferred_free",
    "Prefix caching, deferred frees (W = 1), speculative decoding with 2 drafts a step and 2 look-ahead slots.",
    inflight_window=1,
    speculative_tokens=2,
    lookahead_tokens=2,
)
kv_cache_manager_no_prefix_cache_sliding_window = _factory(
    "kv_cache_manager_no_prefix_cache_sliding_window",
    "A sliding-window group of 12 tokens, no prefix caching.",
    prefix_caching=False,
    sliding_window=12,
)
