"""The host cache tier (``host_cache``): the engine performs the loads and stores an allocator orders, and its checks
catch a tier that serves a block before its store lands, or loads from the wrong host block.

The allocator here is a small one written for this contract: no device prefix cache, a host tier of full blocks
keyed by namespace and token prefix, W = 1. vLLM's CPU offloading is tested against the same checks in its own
environment (engine_tests/test_vllm_offload.py).
"""

from __future__ import annotations

import random
from typing import Optional

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvfuzz.allocator import AdmitResult, Capabilities, GrowResult, HostTransfers, OutOfBlocks, PoolSpec, Slot
from kvfuzz.allocator.errors import InvalidArgument, SequenceExists, UnknownSequence
from kvfuzz.campaign.swarm import draw_swarm, probe_limits
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.engine import Engine
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.profiles import PROFILES
from kvfuzz.statemachines import machine_for


class HostTierAllocator:
    """Device blocks for running sequences, and a host tier of full blocks keyed by (namespace, token prefix).

    A full block is stored to the host at the launch of the step that writes it, and becomes loadable once that
    step completes; admission loads the longest stored prefix (leaving one token to compute). A released device
    block goes back to the free list once the in-flight window has closed and no store still reads it; a host block
    is reused (least recently stored first) only when no load still reads it and its store has landed.
    """

    def __init__(self, spec: PoolSpec) -> None:
        self.block_size, self.num_blocks, self.num_host_blocks = spec.block_size, spec.num_blocks, spec.num_host_blocks
        self.capabilities = Capabilities(prefix_cache=True, namespaces=True, host_cache=True, inflight_window=1)
        self.free_list: list[int] = list(range(spec.num_blocks))  # device blocks ready to hand out
        self.released: list[tuple[int, int]] = []  # (block, fence step): back to free once the fence has completed
        self.tables: dict[str, list[int]] = {}  # running sequence -> its device blocks
        self.tokens: dict[str, tuple[tuple[str, ...], list[int]]] = {}  # running sequence -> namespace, tokens
        self.stored: dict[str, int] = {}  # running sequence -> blocks already offered to the host
        self.host: dict[tuple, int] = {}  # key -> host block, in store order (oldest first)
        self.ready: set[tuple] = set()  # keys whose store has landed
        self.pins: dict[int, int] = {}  # host block -> loads still reading it
        self.storing: dict[int, list[tuple[tuple, int]]] = {}  # step -> (key, device block) of its stores
        self.unsubmitted: list[int] = []  # host blocks of loads ordered since the last launch
        self.loading: dict[int, list[int]] = {}  # step -> host blocks its loads read
        self.last_completed = -1  # the newest completed step

    def _key(self, namespace: tuple[str, ...], tokens: list[int], index: int) -> tuple:
        return (namespace, tuple(tokens[: (index + 1) * self.block_size]))

    def _ready(self, key: tuple) -> bool:
        return key in self.ready

    def admit(self, seq: str, namespace: tuple[str, ...], tokens: tuple[int, ...]) -> AdmitResult:
        if seq in self.tables:
            raise SequenceExists(seq)
        if not tokens:
            raise InvalidArgument("no tokens")
        needed = -(-len(tokens) // self.block_size)
        if needed > len(self.free_list):
            raise OutOfBlocks(f"admit {seq}: {needed} blocks, {len(self.free_list)} free")
        hit = 0
        while hit < (len(tokens) - 1) // self.block_size and self._ready(self._key(namespace, list(tokens), hit)):
            hit += 1
        table = [self.free_list.pop() for _ in range(needed)]
        loads = []
        for index in range(hit):
            host_block = self.host[self._key(namespace, list(tokens), index)]
            self.pins[host_block] = self.pins.get(host_block, 0) + 1
            self.unsubmitted.append(host_block)
            loads.append((host_block, table[index]))
        self.tables[seq], self.tokens[seq], self.stored[seq] = table, (namespace, list(tokens)), hit
        return AdmitResult(table, hit * self.block_size, loads)

    def grow(self, seq: str, tokens: tuple[int, ...]) -> GrowResult:
        if seq not in self.tables:
            raise UnknownSequence(seq)
        if not tokens:
            raise InvalidArgument("no tokens")
        own = self.tokens[seq][1]
        table = self.tables[seq]
        needed = -(-(len(own) + len(tokens)) // self.block_size) - len(table)
        if needed > len(self.free_list):
            raise OutOfBlocks(f"grow {seq}: {needed} blocks, {len(self.free_list)} free")
        table += [self.free_list.pop() for _ in range(needed)]
        start = len(own)
        own += tokens
        size = self.block_size
        return GrowResult([Slot(table[p // size], p % size) for p in range(start, len(own))])

    def _release(self, seq: str) -> None:
        if seq not in self.tables:
            raise UnknownSequence(seq)
        fence = self.last_completed + 1
        self.released += [(block, fence) for block in self.tables.pop(seq)]
        del self.tokens[seq], self.stored[seq]

    def free(self, seq: str) -> None:
        self._release(seq)

    def preempt(self, seq: str) -> None:
        self._release(seq)

    def take_transfers(self, step: int) -> HostTransfers:
        self.loading[step], self.unsubmitted = self.unsubmitted, []
        stores = []
        for seq, table in self.tables.items():
            namespace, tokens = self.tokens[seq]
            for index in range(self.stored[seq], len(tokens) // self.block_size):
                key = self._key(namespace, tokens, index)
                if key in self.host:
                    continue
                host_block = self._host_block()
                if host_block is None:
                    break
                self.host[key] = host_block
                self.storing.setdefault(step, []).append((key, table[index]))
                stores.append((table[index], host_block))
            self.stored[seq] = len(tokens) // self.block_size
        return HostTransfers(stores=stores)

    def _host_block(self) -> Optional[int]:
        used = set(self.host.values())
        unused = [block for block in range(self.num_host_blocks) if block not in used]
        if unused:
            return unused[0]
        for key, block in self.host.items():  # the oldest stored, landed and unread
            if key in self.ready and not self.pins.get(block):
                del self.host[key]
                self.ready.discard(key)
                return block
        return None

    def step_completed(self, step: int) -> None:
        self.last_completed = step
        for key, _ in self.storing.pop(step, ()):
            self.ready.add(key)
        for host_block in self.loading.pop(step, ()):
            self.pins[host_block] -= 1
        reading = {block for stores in self.storing.values() for _, block in stores}
        back = [(block, fence) for block, fence in self.released if fence <= step and block not in reading]
        self.free_list += [block for block, _ in back]
        self.released = [entry for entry in self.released if entry not in back]

    def block_table(self, seq: str) -> tuple[int, ...]:
        if seq not in self.tables:
            raise UnknownSequence(seq)
        return tuple(self.tables[seq])


class ReadyBeforeItLands(HostTierAllocator):
    """Serves a stored block as soon as its store is ordered, before the step that copies it completes."""

    def _ready(self, key: tuple) -> bool:
        return key in self.host


class LoadsTheNextHostBlock(HostTierAllocator):
    """Loads each hit from the host block after the one that holds it."""

    def admit(self, seq, namespace, tokens):
        result = super().admit(seq, namespace, tokens)
        loads = [((host + 1) % self.num_host_blocks, block) for host, block in result.loads]
        return AdmitResult(result.block_table, result.num_cached_tokens, loads)


CONFIG = MachineConfig(block_size=4, num_blocks=8, num_host_blocks=4)
PROMPT = (1, 2, 3, 0, 2, 2, 1, 3, 1)  # two full blocks and one token


def test_the_machine_holds_a_correct_host_tier() -> None:
    run_state_machine_as_test(
        machine_for(HostTierAllocator, CONFIG), settings=settings(PROFILES["ci"], max_examples=60)
    )


def _second_request_hits_the_first(engine: Engine, steps_between: int) -> None:
    assert engine.admit("a", (), PROMPT)
    for _ in range(steps_between):
        engine.step()
    assert engine.admit("b", (), PROMPT + (0,))
    engine.step()  # b's loads land before this step writes and attends


def test_a_hit_loaded_from_the_host_tier_holds_its_prefix() -> None:
    engine = Engine(HostTierAllocator(CONFIG.pool_spec()), CONFIG)
    _second_request_hits_the_first(engine, steps_between=2)  # the stores of step 0 have landed (W = 1)
    assert engine.stats["host-tier loads"] == 2 and engine.expected.seqs["b"].written > 8
    engine.quiesce()


def test_a_block_served_before_its_store_lands_is_caught() -> None:
    engine = Engine(ReadyBeforeItLands(CONFIG.pool_spec()), CONFIG)
    with pytest.raises(InvariantViolation) as caught:
        _second_request_hits_the_first(engine, steps_between=1)  # step 0 (and its stores) not completed yet
    assert caught.value.invariant is Invariant.CONTENT
    assert "loaded from host block" in caught.value.explain() and "nothing" in caught.value.explain()


def test_a_load_from_the_wrong_host_block_is_caught() -> None:
    engine = Engine(LoadsTheNextHostBlock(CONFIG.pool_spec()), CONFIG)
    with pytest.raises(InvariantViolation) as caught:
        _second_request_hits_the_first(engine, steps_between=2)
    assert caught.value.invariant is Invariant.CONTENT


def test_loads_without_host_cache_are_refused() -> None:
    class Undeclared(HostTierAllocator):
        def __init__(self, spec):
            super().__init__(spec)
            self.capabilities = Capabilities(prefix_cache=True, swap=True, inflight_window=1)

        def admit(self, seq, namespace, tokens):
            result = super().admit(seq, namespace, tokens)
            return AdmitResult(result.block_table, 0, [(0, result.block_table[0])])

    engine = Engine(Undeclared(CONFIG.pool_spec()), CONFIG)
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("a", (), PROMPT)
    assert caught.value.invariant is Invariant.CACHE_SOUNDNESS and "host_cache" in caught.value.explain()


def test_a_campaign_gives_a_host_cache_allocator_host_blocks_in_every_pool() -> None:
    def needs_host_blocks(spec: PoolSpec) -> HostTierAllocator:
        if spec.num_host_blocks < 1:
            raise ValueError("a host tier needs host blocks")
        return HostTierAllocator(spec)

    limits = probe_limits("host tier", needs_host_blocks, CONFIG)
    assert limits.host_cache and limits.min_blocks == 1
    rng = random.Random(0)
    draws = [draw_swarm(rng, limits, CONFIG) for _ in range(500)]
    assert min(draw.machine.num_host_blocks for draw in draws) >= 1
    for draw in draws[:50]:
        needs_host_blocks(draw.machine.pool_spec())


class HoldsLoadDestinations(HostTierAllocator):
    """W = 0, introspected: a released block is free at once, unless a load ordered into it has not yet been
    acknowledged, which happens when the step whose launch lands the load completes (as SGLang's HiCache holds a
    load-back's pages until its event poll after that step): until then it is pending."""

    def __init__(self, spec: PoolSpec) -> None:
        super().__init__(spec)
        self.capabilities = Capabilities(prefix_cache=True, namespaces=True, host_cache=True, introspection=True)
        self.filling: dict[int, int] = {}  # device block a load fills -> the step launching it (-1: not launched)

    def admit(self, seq, namespace, tokens):
        result = super().admit(seq, namespace, tokens)
        self.filling.update((block, -1) for _, block in result.loads)
        return result

    def take_transfers(self, step):
        self.filling = {block: step if launched < 0 else launched for block, launched in self.filling.items()}
        return super().take_transfers(step)

    def _release(self, seq):
        super()._release(seq)
        self.free_list += [block for block, _ in self.released if block not in self.filling]
        self.released = [entry for entry in self.released if entry[0] in self.filling]

    def step_completed(self, step):
        self.filling = {block: launched for block, launched in self.filling.items() if launched != step}
        super().step_completed(step)

    def refcount(self, block):
        return sum(table.count(block) for table in self.tables.values())

    def free_blocks(self):
        return self.free_list

    def cached_blocks(self):
        return ()

    def pending_blocks(self):
        return [block for block, _ in self.released]


class FreesLoadDestinationsAtOnce(HoldsLoadDestinations):
    """Hands a released block out again while a load ordered into it has not landed yet."""

    def _release(self, seq):
        HostTierAllocator._release(self, seq)
        self.free_list += [block for block, _ in self.released]
        self.released = []


W0 = MachineConfig(block_size=4, num_blocks=8, num_host_blocks=4)


def test_the_machine_holds_a_tier_that_holds_load_destinations_until_acknowledged() -> None:
    run_state_machine_as_test(
        machine_for(HoldsLoadDestinations, W0), settings=settings(PROFILES["ci"], max_examples=40)
    )


def _loads_then_frees(engine: Engine) -> list[int]:
    """``a`` computes PROMPT (stored to the host as its step completes); ``b`` hits it on the host and is freed
    before any step lands its loads; returns the blocks those loads fill."""
    assert engine.admit("a", (), PROMPT)
    engine.step()
    engine.free("a")
    assert engine.admit("b", (), PROMPT + (0,))
    loading = [block for _, _, block in engine.host_tier.loads]
    assert len(loading) == 2
    engine.free("b")
    return loading


def test_a_load_destination_released_before_the_load_lands_may_stay_pending_until_it_is_acknowledged() -> None:
    allocator = HoldsLoadDestinations(W0.pool_spec())
    engine = Engine(allocator, W0)
    loading = _loads_then_frees(engine)
    assert sorted(allocator.pending_blocks()) == sorted(loading)  # accepted: in flight until the next step completes
    engine.quiesce()  # launches a step that lands the loads, whose completion acknowledges them
    assert engine.stats["host-tier loads"] == 2 and not allocator.pending_blocks() and not engine.host_tier.loads


def test_a_load_destination_handed_out_before_the_load_lands_is_caught() -> None:
    engine = Engine(FreesLoadDestinationsAtOnce(W0.pool_spec()), W0)
    loading = _loads_then_frees(engine)
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("c", (), (3,) * 4 * 8)  # the whole pool, the loads' destinations included
    assert caught.value.invariant is Invariant.NON_REUSE_WINDOW
    assert f"block {loading[0]}" in str(caught.value) or f"block {loading[1]}" in str(caught.value)


class HoldsItsWholeTable(HoldsLoadDestinations):
    """Holds every block of a released table while a load into it is pending, the blocks past the loaded prefix
    (which no load fills and no load extends) included."""

    def _release(self, seq):
        held = any(block in self.filling for block in self.tables.get(seq, ()))
        HostTierAllocator._release(self, seq)
        if not held:
            self.free_list += [block for block, _ in self.released]
            self.released = []


def test_holding_blocks_past_the_prefix_a_pending_load_extends_is_caught() -> None:
    engine = Engine(HoldsItsWholeTable(W0.pool_spec()), W0)
    with pytest.raises(InvariantViolation) as caught:
        _loads_then_frees(engine)  # b's third block holds its computed tail: pending outside any window
    assert caught.value.invariant is Invariant.FREE_SET and "pending" in str(caught.value)
