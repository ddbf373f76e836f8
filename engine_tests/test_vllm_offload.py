"""vLLM's CPU KV offloading as a second cache tier (kvfuzz.adapters.vllm_offload), in vLLM's own environment.

Runs in the environment ``scripts/third_party_env.sh vllm`` builds (CI runs it there): without vLLM 0.33.0 the import
fails loudly rather than skipping. Each check the adapter relies on is shown able to fail: a wrapper that gets one
part of the worker's or the connector's job wrong is caught by kvfuzz's checks.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvfuzz.adapters import vllm_offload
from kvfuzz.allocator import PoolSpec
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.engine import Engine
from kvfuzz.engine.expected import Status
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.profiles import PROFILES
from kvfuzz.statemachines import machine_for

PROMPT = (1, 2, 3, 0, 2, 2, 1, 3, 1)  # two full blocks and one token
# Four device blocks, so that a finished request's blocks are handed out again soon; eight CPU chunks, so that its
# chunks outlive the next request's stores.
CONFIG = MachineConfig(block_size=4, num_blocks=4, num_host_blocks=8)


@pytest.mark.parametrize(
    "factory, examples",
    [
        (vllm_offload.cpu_offloading, None),
        (vllm_offload.cpu_offloading_arc, 40),
        (vllm_offload.cpu_offloading_async_loads, None),
    ],
    ids=lambda value: getattr(value, "__name__", str(value)),
)
def test_machine_holds(factory, examples) -> None:
    """kvfuzz's ci profile (fewer examples for ARC, to keep the suite short)."""
    profile = PROFILES["ci"] if examples is None else settings(PROFILES["ci"], max_examples=examples)
    run_state_machine_as_test(machine_for(factory, MachineConfig()), settings=profile)


def test_declares_a_host_cache_with_the_deferred_free_window() -> None:
    allocator = vllm_offload.cpu_offloading(PoolSpec(4, 8, 4))
    caps = allocator.capabilities
    assert caps.host_cache and not caps.swap and caps.inflight_window == 1 and caps.prefix_cache
    assert allocator.num_host_blocks == 4


def _engine(allocator: object) -> Engine:
    return Engine(allocator, CONFIG)  # type: ignore[arg-type]


def _evicted_prefix_comes_back(engine: Engine) -> None:
    """``a`` fills two blocks and finishes; its GPU copies are evicted; ``d`` with the same prompt then hits them in
    the CPU tier."""
    engine.step()
    assert engine.admit("a", (), PROMPT)
    engine.free("a")
    engine.step()  # launches a's stores
    engine.step()  # completes step 1, which ran a's tokens: a's blocks come back (deferred free, W = 1)
    engine.evict(CONFIG.num_blocks)
    for _ in range(3):
        engine.step()  # a's stores land and are reported complete
    assert engine.admit("d", (), PROMPT + (0,))


def test_a_prefix_evicted_from_the_gpu_is_loaded_back_from_the_cpu_tier() -> None:
    engine = _engine(vllm_offload.cpu_offloading(CONFIG.pool_spec()))
    _evicted_prefix_comes_back(engine)
    assert engine.stats["host-tier loads"] == 2 and engine.stats["cache-hit tokens"] == 8
    assert engine.expected.seqs["d"].written == 8
    engine.step()  # the loads land before the step; the content and attention checks pass
    engine.quiesce()


class _LoadsFromTheWrongChunk(vllm_offload.VllmOffloadAllocator):
    """The worker reads each load from the next CPU chunk instead of the one prepare_load named."""

    def _external_loads(self, seq, request, num_local, num_external):
        loads = super()._external_loads(seq, request, num_local, num_external)
        return tuple(((chunk + 1) % self.num_host_blocks, block) for chunk, block in loads)


class _LoadsIntoTheWrongBlock(vllm_offload.VllmOffloadAllocator):
    """The loads go into the request's first block past its hit instead of the hit's own blocks."""

    def _external_loads(self, seq, request, num_local, num_external):
        loads = super()._external_loads(seq, request, num_local, num_external)
        past_hit = self.block_table(seq)[(num_local + num_external) // self.block_size]
        return tuple((chunk, past_hit) for chunk, _ in loads[:1])


def test_a_load_from_the_wrong_chunk_is_caught_when_it_lands() -> None:
    engine = _engine(_LoadsFromTheWrongChunk(CONFIG.pool_spec()))
    _evicted_prefix_comes_back(engine)
    with pytest.raises(InvariantViolation) as caught:
        engine.step()
    assert caught.value.invariant is Invariant.CONTENT
    assert "loaded from host block" in caught.value.explain()


def test_a_load_into_a_block_outside_the_hit_is_caught_at_admission() -> None:
    engine = _engine(_LoadsIntoTheWrongBlock(CONFIG.pool_spec()))
    with pytest.raises(InvariantViolation) as caught:
        _evicted_prefix_comes_back(engine)
    assert caught.value.invariant is Invariant.CACHE_SOUNDNESS
    assert "loads host block" in caught.value.summary


class _NeverFlushes(vllm_offload.VllmOffloadAllocator):
    """The connector forgets ``jobs_to_flush``: a finished request's store still in flight when its block is handed
    out again is not finished first."""

    def take_transfers(self, step):
        return attrs.evolve(super().take_transfers(step), flushed=())


FLUSH_CONFIG = MachineConfig(block_size=4, num_blocks=6, num_host_blocks=2)
OTHER_PROMPT = (3, 1, 2, 0, 1, 1, 2, 2, 0)


def _block_reused_while_its_store_is_in_flight(engine: Engine) -> None:
    """``x`` fills both CPU chunks; ``a``'s first offer finds them still being written and is refused; ``a``
    finishes, and its last offer, at the next launch, evicts ``x``'s chunks. That store is still in flight when
    ``a``'s blocks come back (they are fenced by the step before), so ``c``, which takes them, makes vLLM flush it.
    Then ``d`` loads ``a``'s prefix from the CPU tier."""
    assert engine.admit("x", (), OTHER_PROMPT)
    engine.step()
    assert engine.admit("a", (), PROMPT)
    engine.step()
    engine.free("x")
    engine.free("a")
    engine.step()  # a's last store goes out; the step before completes and a's blocks come back
    engine.evict(FLUSH_CONFIG.num_blocks)
    assert engine.admit("c", (), (3,) * 24)  # every block, a's among them
    engine.step()  # the flush lands a's store before c writes its blocks
    engine.free("c")
    engine.step()
    engine.step()
    assert engine.admit("d", (), PROMPT)
    assert engine.stats["host-tier loads"] == 2
    engine.step()


def test_the_flush_of_a_reused_block_keeps_the_cpu_copy_right() -> None:
    engine = Engine(vllm_offload.cpu_offloading(FLUSH_CONFIG.pool_spec()), FLUSH_CONFIG)
    _block_reused_while_its_store_is_in_flight(engine)
    engine.quiesce()


def test_a_missing_flush_is_caught_when_the_stale_copy_is_loaded() -> None:
    engine = Engine(_NeverFlushes(FLUSH_CONFIG.pool_spec()), FLUSH_CONFIG)
    with pytest.raises(InvariantViolation) as caught:
        _block_reused_while_its_store_is_in_flight(engine)
    assert caught.value.invariant is Invariant.CONTENT
    assert "K/V of sequence c" in caught.value.explain()


class _FlushesWhatIsNotInFlight(vllm_offload.VllmOffloadAllocator):
    """Reports every store it ever ordered as flushed again at each launch."""

    def __init__(self, spec):
        super().__init__(spec)
        self.ordered: list[tuple[int, int]] = []

    def take_transfers(self, step):
        transfers = super().take_transfers(step)
        self.ordered += transfers.stores
        return attrs.evolve(transfers, flushed=tuple(self.ordered[:1]) if step >= 3 else transfers.flushed)


def test_a_flush_of_a_store_already_landed_is_caught() -> None:
    engine = _engine(_FlushesWhatIsNotInFlight(CONFIG.pool_spec()))
    with pytest.raises(InvariantViolation) as caught:
        _evicted_prefix_comes_back(engine)
    assert caught.value.invariant is Invariant.RESULTS
    assert "not in flight" in caught.value.summary


class _ForgetsCachedChunks(vllm_offload.VllmOffloadAllocator):
    """A CPU free set that leaves out the cached chunks no transfer uses, which the policy may evict."""

    def host_free_blocks(self):
        cpu = self._cpu
        return [*range(cpu._num_allocated_chunks, cpu._num_chunks), *cpu._free_list]


def test_the_cpu_tier_free_set_is_checked() -> None:
    """The adapter lists the CPU tier's free chunks, so a CPU chunk lost to the free set is caught: the right list
    passes quiescence, one without the cached chunks fails it naming them."""
    engine = _engine(vllm_offload.cpu_offloading(CONFIG.pool_spec()))
    _evicted_prefix_comes_back(engine)
    engine.step()
    engine.quiesce()
    engine = _engine(_ForgetsCachedChunks(CONFIG.pool_spec()))
    _evicted_prefix_comes_back(engine)
    engine.step()
    with pytest.raises(InvariantViolation) as caught:
        engine.quiesce()
    assert caught.value.invariant is Invariant.QUIESCENCE
    assert "leaked:   [0, 1]" in caught.value.explain()


# -- asynchronous loads (cpu_offloading_async_loads): the request waits, WAITING_FOR_REMOTE_KVS ----------------------


def _async_engine(allocator_class: type = vllm_offload.VllmOffloadAllocator) -> Engine:
    return _engine(allocator_class(CONFIG.pool_spec(), asynchronous_loads=True))


def test_an_asynchronous_load_makes_the_request_wait_until_it_is_reported() -> None:
    engine = _async_engine()
    assert engine.allocator.capabilities.async_loads
    _evicted_prefix_comes_back(engine)
    d = engine.expected.seqs["d"]
    assert d.status is Status.LOADING and len(d.table) == 2  # blocks for the 8 loaded tokens alone
    request = engine.allocator._loading["d"]
    assert request.status is request.status.WAITING_FOR_REMOTE_KVS
    for _ in range(3):  # the loads stay in flight over several steps; d computes nothing
        engine.step()
    assert "d" in engine.expected.landable_ids() and d.status is Status.LOADING
    engine.land_loads("d")  # complete_load, then the delayed cache_blocks
    assert d.status is Status.LOADED
    assert engine.resume("d")  # allocate_slots for the last two tokens
    engine.step()
    assert engine.expected.computed_ids() == ["d"] and engine.stats["resumed after asynchronous loads"] == 1
    engine.quiesce()


def test_a_request_aborted_while_loading_keeps_its_blocks_until_its_loads_land() -> None:
    engine = _async_engine()
    _evicted_prefix_comes_back(engine)
    loading = list(engine.expected.seqs["d"].table)
    engine.free("d")  # delay_free_blocks: vLLM keeps them until finished_recving
    engine.step()
    engine.step()
    assert sorted(engine.allocator.pending_blocks()) == sorted(loading)
    engine.land_loads("d")  # _free_blocks, through the deferred frees (W = 1)
    engine.step()
    engine.step()
    assert not engine.allocator.pending_blocks()
    engine.quiesce()


class _FreesLoadingRequestsAtOnce(vllm_offload.VllmOffloadAllocator):
    """Frees a request aborted while loading at once, as if its loads could not land any more."""

    def _free_waiting(self, seq):
        if seq in self._loading:
            self._landed[seq] = self._loading.pop(seq)
        super()._free_waiting(seq)


def test_blocks_of_an_aborted_loading_request_handed_out_before_its_loads_land_are_caught() -> None:
    engine = _async_engine(_FreesLoadingRequestsAtOnce)
    _evicted_prefix_comes_back(engine)
    engine.free("d")
    engine.step()
    engine.step()  # the deferred free (W = 1) returns d's blocks
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("e", (), (3,) * 4 * CONFIG.num_blocks)  # the whole pool
    assert caught.value.invariant is Invariant.NON_REUSE_WINDOW
    assert "asynchronous load still fills it" in str(caught.value)


class _CompletesLoadsWithTheirStep(vllm_offload.VllmOffloadAllocator):
    """Reports an asynchronous load complete to the CPU manager when the step that started it completes, as for a
    synchronous one: its chunks are unpinned while the worker may still read them."""

    def _external_loads(self, seq, request, num_local, num_external):
        loads = super()._external_loads(seq, request, num_local, num_external)
        if seq in self._async_jobs:
            self._unsubmitted.append(self._async_jobs[seq])
        return loads

    def loads_landed(self, seq):
        job_id = self._async_jobs.pop(seq)
        if job_id in self._jobs:
            self._complete(job_id)
        vllm_offload.VllmV1Allocator.loads_landed(self, seq)


def test_cpu_chunks_released_before_the_asynchronous_load_is_reported_are_caught() -> None:
    engine = _async_engine(_CompletesLoadsWithTheirStep)
    _evicted_prefix_comes_back(engine)
    engine.step()
    with pytest.raises(InvariantViolation) as caught:
        engine.step()  # the step that started d's loads completes: the CPU manager unpins their chunks
    assert caught.value.invariant is Invariant.FREE_SET


def _run(engine: Engine, calls: list[tuple[str, dict]]) -> None:
    from kvfuzz.program.operations import BY_NAME

    for name, arguments in calls:
        assert BY_NAME[name].accepts(engine.expected, arguments), (name, arguments)
        BY_NAME[name].apply(engine, **arguments)
    engine.quiesce()


SYSTEM = (1, 0, 3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1)


def test_a_block_two_aborted_loading_requests_share_stays_held_until_both_loads_land() -> None:
    """s3 and s4 both hit block 0 on the GPU and load the rest; both are aborted while loading. When s4's loads land
    vLLM still holds block 0 for s3 (delay_free_blocks), which kvfuzz once reported as a block pending outside any
    window (a campaign's false report, fixed in the engine)."""
    config = MachineConfig(block_size=8, num_blocks=5, num_host_blocks=4, inflight_window=1)
    engine = Engine(vllm_offload.cpu_offloading_async_loads(config.pool_spec()), config)
    _run(
        engine,
        [
            ("admit", dict(seq="s0", namespace=(), system=SYSTEM, suffix=[0])),
            ("step", {}),
            ("admit", dict(seq="s1", namespace=(), system=(), suffix=[0])),
            ("free", dict(seq="s0")),
            ("step", {}),
            ("admit", dict(seq="s2", namespace=(), system=SYSTEM[1:], suffix=[0])),
            ("free", dict(seq="s2")),
            ("step", {}),
            ("step", {}),
            ("admit", dict(seq="s3", namespace=(), system=SYSTEM, suffix=[0])),
            ("admit", dict(seq="s4", namespace=(), system=SYSTEM, suffix=[0])),
            ("free", dict(seq="s4")),
            ("step", {}),
            ("free", dict(seq="s3")),
            ("step", {}),
            ("land_loads", dict(seq="s4")),
            ("step", {}),
        ],
    )
    assert engine.stats["admissions waiting for their loads"] == 2


def test_a_reset_cache_leaves_the_blocks_of_an_aborted_loading_request_matchable() -> None:
    """vLLM holds an aborted loading request's blocks until its loads land, so reset_cache cannot drop the GPU hit
    among them, and a later request hits it (kvfuzz once reported that hit as a hit on an evicted block)."""
    config = MachineConfig(block_size=4, num_blocks=5, num_host_blocks=3, inflight_window=1)
    engine = Engine(vllm_offload.cpu_offloading_async_loads(config.pool_spec()), config)
    system, namespace = (1, 0, 3, 2, 1, 0, 3, 2, 1), ("a", "bc")
    _run(
        engine,
        [
            ("admit", dict(seq="s0", namespace=(), system=(), suffix=[0])),
            ("free", dict(seq="s0")),
            ("admit", dict(seq="s1", namespace=(), system=(), suffix=[0])),
            ("admit", dict(seq="s2", namespace=namespace, system=system, suffix=[0, 0, 0])),
            ("step", {}),
            ("preempt", dict(seq="s2")),
            ("decode", dict(token=0)),
            ("evict", dict(num_blocks=2)),
            ("admit", dict(seq="s3", namespace=namespace, system=system, suffix=[0])),
            ("free", dict(seq="s3")),
            ("step", {}),
            ("reset_cache", {}),
            ("admit", dict(seq="s4", namespace=namespace, system=system, suffix=[0])),
        ],
    )
    assert engine.stats["cache-hit tokens"] >= 8
