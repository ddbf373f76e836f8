"""``shares_host_blocks``: a swap-out may map a device block to a host block another swapped-out sequence holds, only
when that host block holds the same K/V (vLLM v0's host allocator deduplicates full blocks by content); the host
block then stays out of the host free set until its last holder goes. Any other sharing stays a violation."""

from __future__ import annotations

from typing import Hashable, Optional

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from kvfuzz.allocator import OutOfBlocks, PoolSpec, SwapResult
from kvfuzz.allocator.paged import PagedAllocator, _Sequence
from kvfuzz.allocator.types import Capabilities, SeqId
from kvfuzz.engine import Engine, Invariant, InvariantViolation
from kvfuzz.statemachines import MachineConfig, machine_for

CONFIG = MachineConfig(block_size=4, num_blocks=8, num_host_blocks=6)
PROMPT = (1, 2, 3, 4, 5, 6)  # one full block and a partial one


class _SharesHostBlocks(PagedAllocator):
    """kvfuzz's allocator (W = 0) whose swap-out reuses the host copy of a full block that another swapped-out
    sequence holds with the same namespace and tokens up to its end, as vLLM v0's host allocator does. Seeded bugs:
    ``by_index`` keys a host copy by the logical index alone (another prefix's K/V shared), and ``frees_early`` puts
    a shared host block back in the host free set when its first holder is swapped in or freed."""

    def __init__(self, spec: PoolSpec, *, declare: bool = True, by_index: bool = False, frees_early: bool = False):
        super().__init__(spec.block_size, spec.num_blocks, spec.num_host_blocks)
        self.capabilities = attrs.evolve(self.capabilities, shares_host_blocks=declare)
        self._by_index = by_index  # the seeded bug: any full block at that index shares the host copy
        self._frees_early = frees_early  # the seeded bug: a shared host block freed by its first holder
        self._copies: dict[Hashable, int] = {}  # a full block's content key -> the host block holding it
        self._holders: dict[int, int] = {}  # host block -> how many swapped-out sequences hold it

    def swap_out(self, seq: SeqId) -> SwapResult:
        state = self._running(seq, "swap_out")
        keys = [self._key(state, index) for index in range(len(state.table))]
        fresh = sum(key is None or key not in self._copies for key in keys)
        if fresh > len(self._host_free):
            raise OutOfBlocks(f"swap_out: {seq!r} needs {fresh} host block(s), {len(self._host_free)} free")
        host = []
        for key in keys:
            block = None if key is None else self._copies.get(key)
            if block is None:
                block = next(iter(self._host_free))
                del self._host_free[block]
                if key is not None:
                    self._copies[key] = block
            self._holders[block] = self._holders.get(block, 0) + 1
            host.append(block)
        mapping = list(zip(state.table, host))
        self._release_table(state)
        state.table, state.versions, state.host_table = [], [], host
        return SwapResult(mapping)

    def swap_in(self, seq: SeqId) -> SwapResult:
        held = self._host_table(seq)
        result = super().swap_in(seq)  # puts every host block it held back in the free set
        self._let_go(held)
        return result

    def free(self, seq: SeqId) -> None:
        held = self._host_table(seq)
        super().free(seq)
        self._let_go(held)

    def _host_table(self, seq: SeqId) -> list[int]:
        state = self._seqs.get(seq)
        return list(state.host_table or ()) if state is not None else []

    def _let_go(self, host_blocks: list[int]) -> None:
        """One holder fewer for each host block: one still held by others leaves the free set again."""
        for block in host_blocks:
            self._holders[block] -= 1
            if self._holders[block] and not self._frees_early:
                del self._host_free[block]
                continue
            self._copies = {key: held for key, held in self._copies.items() if held != block}
            if not self._holders[block]:
                del self._holders[block]

    def _key(self, state: _Sequence, index: int) -> Optional[Hashable]:
        """What names a full block's host copy (None for a partial block, never shared)."""
        end = (index + 1) * self.block_size
        if end > len(state.tokens):
            return None
        return index if self._by_index else (state.namespace, tuple(state.tokens[:end]))


def host_sharing_allocator(spec: PoolSpec) -> PagedAllocator:
    """The correct _SharesHostBlocks, for the machine."""
    return _SharesHostBlocks(spec)


def _two_swapped_out(allocator: PagedAllocator, second_prompt: tuple[int, ...] = PROMPT) -> Engine:
    """``a`` and ``b`` computed and swapped out one after the other: the second swap-out meets a host block the
    first holds (their first full blocks have the same K/V when the prompts agree on it)."""
    engine = Engine(allocator, CONFIG)
    engine.admit("a", (), PROMPT)
    engine.step()
    assert engine.swap_out("a")
    engine.admit("b", (), second_prompt)
    engine.step()
    assert engine.swap_out("b")
    return engine


def test_a_declared_host_block_shared_with_the_same_content_is_accepted() -> None:
    allocator = _SharesHostBlocks(CONFIG.pool_spec())
    engine = _two_swapped_out(allocator)
    a, b = engine.expected.seqs["a"].host_table, engine.expected.seqs["b"].host_table
    assert a[0] == b[0] and a[1] != b[1], "the full block's host copy is shared, the partial ones are not"
    assert sorted(allocator.host_free_blocks()) == sorted(set(range(6)) - {a[0], a[1], b[1]})


def test_a_shared_host_block_stays_held_until_its_last_holder_goes_and_swaps_in_the_right_content() -> None:
    allocator = _SharesHostBlocks(CONFIG.pool_spec())
    engine = _two_swapped_out(allocator)
    shared = engine.expected.seqs["a"].host_table[0]
    assert engine.swap_in("a")
    assert shared not in allocator.host_free_blocks()
    engine.step()  # attention reads every position of a, swapped in from the shared host block
    assert engine.swap_in("b")
    assert shared in allocator.host_free_blocks()
    engine.step()
    engine.quiesce()


def test_freeing_one_holder_keeps_the_shared_host_block_for_the_other() -> None:
    allocator = _SharesHostBlocks(CONFIG.pool_spec())
    engine = _two_swapped_out(allocator)
    shared = engine.expected.seqs["b"].host_table[0]
    engine.free("b")
    assert shared not in allocator.host_free_blocks()
    assert engine.swap_in("a")
    engine.step()
    engine.quiesce()


def test_without_the_declaration_a_shared_host_block_is_still_reported() -> None:
    with pytest.raises(InvariantViolation) as caught:
        _two_swapped_out(_SharesHostBlocks(CONFIG.pool_spec(), declare=False))
    assert caught.value.invariant is Invariant.CONTENT
    assert caught.value.operation == "swap_out('b')"
    assert "reuses host block(s)" in caught.value.summary


def test_a_host_block_shared_with_other_content_is_caught_at_the_swap_out() -> None:
    with pytest.raises(InvariantViolation) as caught:
        _two_swapped_out(_SharesHostBlocks(CONFIG.pool_spec(), by_index=True), second_prompt=(9, 2, 3, 4, 5, 6))
    violation = caught.value
    assert violation.invariant is Invariant.CONTENT
    assert violation.operation == "swap_out('b')"
    assert "maps its logical block 0" in violation.summary and "which swapped-out a holds with other K/V" in (
        violation.summary
    )
    assert "position 0 differs" in str(violation)


def test_a_shared_host_block_freed_by_its_first_holder_is_caught() -> None:
    engine = _two_swapped_out(_SharesHostBlocks(CONFIG.pool_spec(), frees_early=True))
    with pytest.raises(InvariantViolation) as caught:
        engine.swap_in("a")
    violation = caught.value
    assert violation.invariant is Invariant.FREE_SET
    assert "holds swapped-out b's logical block 0, yet is listed in the host free set" in violation.summary


class _RefusesTheLastHostBlock(_SharesHostBlocks):
    """The sharing allocator with an off-by-one: it refuses a swap-out while one host block is free."""

    def swap_out(self, seq: SeqId) -> SwapResult:
        self._running(seq, "swap_out")
        if len(self._host_free) == 1:
            raise OutOfBlocks(f"swap_out: {seq!r} refused with one host block free")
        return super().swap_out(seq)


def test_a_false_host_refusal_counts_a_shared_host_block_once() -> None:
    """Four host blocks, three held (a and b share one): the one free block holds c's single block, so refusing c
    is false. Counting the shared block once per holder (four held) would excuse the refusal."""
    config = MachineConfig(block_size=4, num_blocks=8, num_host_blocks=4)
    engine = Engine(_RefusesTheLastHostBlock(config.pool_spec()), config)
    for seq in ("a", "b"):
        engine.admit(seq, (), PROMPT)
        engine.step()
        assert engine.swap_out(seq)
    assert engine.expected.host_blocks_in_use() == 3
    engine.admit("c", (), (7, 7, 7))
    engine.step()
    with pytest.raises(InvariantViolation) as caught:
        engine.swap_out("c")
    assert caught.value.invariant is Invariant.NO_FALSE_REFUSAL
    assert "host pool could serve it" in caught.value.summary


def test_the_machine_finds_nothing_to_report_in_the_sharing_allocator() -> None:
    config = MachineConfig(block_size=2, num_blocks=8, num_host_blocks=6)
    quick = settings(max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck))
    run_state_machine_as_test(machine_for(host_sharing_allocator, config), settings=quick)


def test_the_declaration_needs_swap() -> None:
    with pytest.raises(ValueError, match="shares_host_blocks needs swap"):
        Capabilities(shares_host_blocks=True)
