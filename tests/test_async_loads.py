"""Asynchronous host-tier loads (``async_loads``): an admission that waits for its loads over several steps, as vLLM's
connectors load (``WAITING_FOR_REMOTE_KVS``). The engine starts the loads at the next launch, performs and reports
them later (``land_loads``), and the sequence is scheduled afterwards (``resume``); a sequence freed while loading
keeps its loaded blocks in flight until the loads are reported.

The allocator here extends the host tier of tests/test_host_cache.py: an admission with a host hit allocates blocks
for the hit alone and waits. Its broken variants each slip on one rule, and each is caught with the invariant named.
vLLM's CPU offloading with asynchronous loads is tested against the same checks in its own environment
(engine_tests/test_vllm_offload.py).
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from test_host_cache import HostTierAllocator

from kvfuzz.allocator import AdmitResult, Capabilities, OutOfBlocks, PoolSpec
from kvfuzz.allocator.errors import SequenceExists, UnknownSequence
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.engine import Engine
from kvfuzz.engine.expected import Status
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.profiles import PROFILES
from kvfuzz.program.execution import Target
from kvfuzz.program.operations import BY_NAME
from kvfuzz.program.random_programs import random_search
from kvfuzz.program.stats import RunStats
from kvfuzz.statemachines import machine_for


class AsyncHostTierAllocator(HostTierAllocator):
    """The host tier, W = 1, introspected, whose host hits load asynchronously.

    An admission with a host hit takes blocks for the hit alone and waits (``waiting``) until its loads are reported
    landed; ``resume`` then allocates the rest of the prompt. The host blocks a load reads stay pinned until it is
    reported landed. A sequence freed while loading keeps its blocks until then (``orphans``), as vLLM delays the
    free of a request whose loads are in flight.
    """

    def __init__(self, spec: PoolSpec) -> None:
        super().__init__(spec)
        self.capabilities = Capabilities(
            prefix_cache=True,
            namespaces=True,
            host_cache=True,
            async_loads=True,
            inflight_window=1,
            introspection=True,
        )
        # Sequence waiting for its loads or for resume -> (namespace, prompt, hit blocks, host blocks its loads read).
        self.waiting: dict[str, tuple[tuple[str, ...], list[int], list[int], list[int]]] = {}
        self.landed: set[str] = set()  # waiting sequences whose loads were reported landed
        self.orphans: dict[str, list[int]] = {}  # freed while loading -> its blocks, released once the loads land
        self.orphan_hosts: dict[str, list[int]] = {}  # freed while loading -> the host blocks its loads read

    def admit(self, seq, namespace, tokens):
        if seq in self.waiting:
            raise SequenceExists(f"admit: {seq} is waiting for its loads")
        pending = list(self.unsubmitted)
        result = super().admit(seq, namespace, tokens)
        if not result.loads:
            return result
        self.unsubmitted = pending  # these loads are not landed by a launch: they wait for loads_landed
        hit_blocks = -(-result.num_cached_tokens // self.block_size)
        table = self.tables.pop(seq)
        self.free_list += table[hit_blocks:]
        del self.tokens[seq], self.stored[seq]
        hosts = [host for host, _ in result.loads]
        self.waiting[seq] = (namespace, list(tokens), table[:hit_blocks], hosts)
        return AdmitResult(table[:hit_blocks], result.num_cached_tokens, result.loads, waits_for_loads=True)

    def loads_landed(self, seq: str) -> None:
        hosts = self.waiting[seq][3] if seq in self.waiting else self.orphan_hosts.pop(seq)
        for host in hosts:
            self.pins[host] -= 1
        if seq in self.orphans:
            self.released += [(block, self.last_completed + 1) for block in self.orphans.pop(seq)]
        else:
            self.landed.add(seq)

    def resume(self, seq: str) -> AdmitResult:
        if seq not in self.landed:
            raise UnknownSequence(f"{seq} has no landed loads")
        namespace, tokens, hit, _ = self.waiting[seq]
        needed = -(-len(tokens) // self.block_size) - len(hit)
        if needed > len(self.free_list):
            raise OutOfBlocks(f"resume {seq}: {needed} blocks, {len(self.free_list)} free")
        table = self._resumed_table(hit, needed)
        del self.waiting[seq]
        self.landed.discard(seq)
        self.tables[seq], self.tokens[seq], self.stored[seq] = table, (namespace, tokens), len(hit)
        return AdmitResult(table, len(hit) * self.block_size)

    def _resumed_table(self, hit: list[int], needed: int) -> list[int]:
        return hit + [self.free_list.pop() for _ in range(needed)]

    def free(self, seq: str) -> None:
        if seq not in self.waiting:
            super().free(seq)
        elif seq in self.landed:
            self.landed.discard(seq)
            self.released += [(block, self.last_completed + 1) for block in self.waiting.pop(seq)[2]]
        else:
            _, _, hit, hosts = self.waiting.pop(seq)
            self._free_loading(seq, hit, hosts)

    def _free_loading(self, seq: str, hit: list[int], hosts: list[int]) -> None:
        self.orphans[seq], self.orphan_hosts[seq] = hit, hosts

    def block_table(self, seq: str) -> tuple[int, ...]:
        if seq in self.waiting:
            return tuple(self.waiting[seq][2])
        return super().block_table(seq)

    def refcount(self, block: int) -> int:
        held = [*self.tables.values(), *(entry[2] for entry in self.waiting.values())]
        return sum(table.count(block) for table in held)

    def free_blocks(self):
        return self.free_list

    def cached_blocks(self):
        return ()

    def pending_blocks(self):
        return [block for block, _ in self.released] + [block for table in self.orphans.values() for block in table]


class FreesLoadingBlocksAtOnce(AsyncHostTierAllocator):
    """Frees a loading sequence's blocks at once, as if its loads could not land any more."""

    def _free_loading(self, seq, hit, hosts):
        self.orphan_hosts[seq] = hosts
        self.free_list += hit


class UnpinsWhenItsStepCompletes(AsyncHostTierAllocator):
    """Treats an asynchronous load as a synchronous one: its host blocks are unpinned when the step that started it
    completes, so a store may overwrite one before the load has read it."""

    def admit(self, seq, namespace, tokens):
        result = super().admit(seq, namespace, tokens)
        self.unsubmitted += [host for host, _ in result.loads]
        return result

    def loads_landed(self, seq):
        hosts = self.waiting[seq][3] if seq in self.waiting else self.orphan_hosts[seq]
        for host in hosts:
            self.pins[host] += 1  # already unpinned: keep the count even
        super().loads_landed(seq)


class ResumesIntoFreshBlocks(AsyncHostTierAllocator):
    """Resumes a sequence into fresh blocks, leaving behind the ones its loads filled."""

    def _resumed_table(self, hit, needed):
        fresh = [self.free_list.pop() for _ in range(len(hit) + needed)]
        self.released += [(block, self.last_completed + 1) for block in hit]
        return fresh


CONFIG = MachineConfig(block_size=4, num_blocks=8, num_host_blocks=4)
PROMPT = (1, 2, 3, 0, 2, 2, 1, 3, 1)  # two full blocks and one token


def _stored_then_waiting(engine: Engine) -> None:
    """``a`` computes PROMPT, whose two full blocks are stored to the host as its step completes, and is freed; ``b``
    hits them on the host and waits for its loads, which the next launch starts."""
    assert engine.admit("a", (), PROMPT)
    engine.step()
    engine.step()  # step 0's stores have landed (W = 1)
    engine.free("a")
    engine.step()
    assert engine.admit("b", (), PROMPT + (0,))
    assert engine.expected.seqs["b"].status is Status.LOADING and len(engine.expected.seqs["b"].table) == 2


def _land(engine: Engine, seq: str) -> None:
    """Steps until ``seq``'s loads may be reported, then reports them."""
    while seq not in engine.expected.landable_ids():
        engine.step()
    engine.land_loads(seq)


def test_a_sequence_waits_for_its_loads_over_several_steps_then_resumes() -> None:
    allocator = AsyncHostTierAllocator(CONFIG.pool_spec())
    engine = Engine(allocator, CONFIG)
    _stored_then_waiting(engine)
    for _ in range(3):  # the loads stay in flight while other steps run
        engine.step()
    assert "b" in engine.expected.landable_ids() and engine.expected.seqs["b"].status is Status.LOADING
    held = engine.occupancy()  # b's two blocks count as held, filled up to its hit
    assert (held.sequences, held.referenced_blocks, held.effective_positions) == (1, 2, 8)
    engine.land_loads("b")
    assert engine.expected.seqs["b"].status is Status.LOADED and engine.expected.seqs["b"].written == 8
    assert engine.resume("b")
    engine.step()  # b's last two tokens are written, and it attends over the loaded prefix
    assert engine.expected.computed_ids() == ["b"]
    assert engine.stats["asynchronous loads landed"] == 1 and engine.stats["host-tier loads"] == 2
    engine.quiesce()


def test_a_sequence_freed_while_loading_keeps_its_blocks_until_its_loads_land() -> None:
    allocator = AsyncHostTierAllocator(CONFIG.pool_spec())
    engine = Engine(allocator, CONFIG)
    _stored_then_waiting(engine)
    loading = list(engine.expected.seqs["b"].table)
    engine.free("b")
    engine.step()
    engine.step()
    assert sorted(allocator.pending_blocks()) == sorted(loading)  # accepted: the worker still writes them
    engine.land_loads("b")
    engine.step()
    engine.step()
    assert not allocator.pending_blocks() and not engine.pools.late_work_by_block
    engine.quiesce()


def test_a_loading_sequence_s_blocks_handed_out_before_its_loads_land_are_caught() -> None:
    engine = Engine(FreesLoadingBlocksAtOnce(CONFIG.pool_spec()), CONFIG)
    _stored_then_waiting(engine)
    loading = list(engine.expected.seqs["b"].table)
    engine.free("b")
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("c", (), (3,) * 4 * 8)  # the whole pool, the loading blocks included
    assert caught.value.invariant is Invariant.NON_REUSE_WINDOW
    assert "asynchronous load still fills it" in str(caught.value)
    assert any(f"block {block} " in str(caught.value) for block in loading)


def test_a_host_block_overwritten_before_an_asynchronous_load_reads_it_is_caught() -> None:
    full_host = MachineConfig(block_size=4, num_blocks=8, num_host_blocks=2)  # a's two blocks fill the host tier
    engine = Engine(UnpinsWhenItsStepCompletes(full_host.pool_spec()), full_host)
    _stored_then_waiting(engine)
    engine.step()  # launches b's loads
    engine.step()  # completes the step that launched them: the sync-minded allocator unpins their host blocks
    assert engine.admit("c", (), (3, 3, 3, 3, 2, 2, 2, 2, 1))  # two new full blocks, stored at the next launch
    engine.step()
    engine.step()  # c's stores land in the host blocks b still loads from (the tier is full)
    with pytest.raises(InvariantViolation) as caught:
        engine.land_loads("b")
    assert caught.value.invariant is Invariant.CONTENT
    assert "loaded asynchronously from host block" in caught.value.explain()


def test_a_resume_that_leaves_the_loaded_blocks_behind_is_caught() -> None:
    engine = Engine(ResumesIntoFreshBlocks(CONFIG.pool_spec()), CONFIG)
    _stored_then_waiting(engine)
    _land(engine, "b")
    loaded = list(engine.expected.seqs["b"].table)
    with pytest.raises(InvariantViolation) as caught:
        engine.resume("b")
    assert caught.value.invariant is Invariant.CACHE_SOUNDNESS
    assert "resume of b maps its cached logical block 0" in str(caught.value) and str(loaded) in str(caught.value)


def test_waiting_for_loads_is_refused_unless_declared() -> None:
    with pytest.raises(ValueError, match="async_loads needs host_cache"):
        Capabilities(async_loads=True)

    class Undeclared(AsyncHostTierAllocator):
        def __init__(self, spec):
            super().__init__(spec)
            self.capabilities = Capabilities(prefix_cache=True, namespaces=True, host_cache=True, inflight_window=1)

    engine = Engine(Undeclared(CONFIG.pool_spec()), CONFIG)
    with pytest.raises(InvariantViolation) as caught:
        _stored_then_waiting(engine)
    assert caught.value.invariant is Invariant.RESULTS and "async_loads" in caught.value.explain()


def test_only_loading_and_loaded_sequences_are_offered_to_land_and_resume() -> None:
    engine = Engine(AsyncHostTierAllocator(CONFIG.pool_spec()), CONFIG)
    _stored_then_waiting(engine)
    state = engine.expected
    assert not BY_NAME["land_loads"].enabled(state)  # not launched yet
    for name in ("grow", "fork", "preempt", "rollback", "swap_out"):
        operation = BY_NAME[name]
        assert not operation.accepts(state, {"seq": "b", "tokens": [1]} if name == "grow" else {"seq": "b"})
    engine.step()
    engine.step()
    assert BY_NAME["land_loads"].accepts(state, {"seq": "b"}) and not BY_NAME["resume"].enabled(state)
    engine.land_loads("b")
    assert BY_NAME["resume"].accepts(state, {"seq": "b"}) and not BY_NAME["land_loads"].enabled(state)


@pytest.mark.slow
def test_the_machine_holds_a_correct_asynchronous_host_tier() -> None:
    run_state_machine_as_test(
        machine_for(AsyncHostTierAllocator, CONFIG), settings=settings(PROFILES["ci"], max_examples=80)
    )


def test_random_programs_wait_land_and_resume_on_a_correct_asynchronous_host_tier() -> None:
    """Random programs (a campaign's search) reach every state of an asynchronous admission, and find nothing."""
    stats = RunStats()
    found = random_search(Target(AsyncHostTierAllocator, CONFIG, stats), examples=150, steps=60, seed=0)
    assert found is None, found
    counts = stats.operations
    assert counts["admissions waiting for their loads"] >= 50 and counts["resumed after asynchronous loads"] >= 5
    assert counts["asynchronous loads landed"] >= 50 and counts["free"] >= 50
