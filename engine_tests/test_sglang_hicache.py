"""SGLang's radix cache with its host tier (HiCache) behind kvfuzz's contract (kvfuzz.adapters.sglang.hicache).

Runs in SGLang's own environment (``scripts/third_party_env.sh sglang``; CI runs it there): without SGLang the
import fails loudly rather than skipping.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvfuzz.adapters.sglang._engine import in_context
from kvfuzz.adapters.sglang.adapter import SGLangRadixAllocator
from kvfuzz.adapters.sglang.hicache import (
    SGLangHiCacheAllocator,
    SGLangHiCacheRustAllocator,
    hiradix_cache,
    hiradix_cache_rust,
    hiradix_cache_rust_write_back,
    hiradix_cache_write_back,
    hiradix_cache_write_through_selective,
)
from kvfuzz.allocator import HostTransfers, PoolSpec
from kvfuzz.engine import Engine
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.profiles import PROFILES
from kvfuzz.statemachines import MachineConfig, machine_for

PROMPT = (1, 2, 3, 0, 2, 2, 1, 3, 0, 1, 2, 3, 3)  # three full pages of four tokens and one more
OTHER = (3, 1, 0, 2) * 3 + (1,)  # as long, nothing in common with PROMPT


HOST_TIER = MachineConfig(block_size=8, num_blocks=6, num_host_blocks=12)
"""A device pool small enough that cached prefixes leave it for the host, and a host pool twice its size; pages of
eight tokens, so that a host hit of two pages clears SGLang's load-back threshold (10 tokens) and is loaded back."""


def test_machine_under_the_ci_profile() -> None:
    run_state_machine_as_test(machine_for(hiradix_cache, MachineConfig()), settings=PROFILES["ci"])


@pytest.mark.parametrize(
    "factory",
    [
        hiradix_cache,
        hiradix_cache_write_back,
        hiradix_cache_write_through_selective,
        hiradix_cache_rust,
        hiradix_cache_rust_write_back,
    ],
)
def test_machine_with_a_host_tier_larger_than_the_device(factory) -> None:
    run_state_machine_as_test(machine_for(factory, HOST_TIER), settings=settings(PROFILES["ci"], max_examples=60))


def _finished(allocator: SGLangHiCacheAllocator, seq: str, tokens: tuple[int, ...], step: int) -> tuple[int, ...]:
    """Admit ``tokens``, run the step that computes them, finish: the prompt's pages go into the tree."""
    table = allocator.admit(seq, (), tokens).block_table
    allocator.step_completed(step)
    allocator.free(seq)
    return table


def test_the_host_pool_has_the_spec_pages_and_all_are_free() -> None:
    allocator = hiradix_cache(PoolSpec(block_size=4, num_blocks=8, num_host_blocks=6))
    assert allocator.num_host_blocks == 6
    assert sorted(allocator.host_free_blocks()) == list(range(6))
    assert allocator.host_pool.available_size() == 6 * 4


def test_write_through_backs_a_finished_prompt_up_to_the_host() -> None:
    allocator = hiradix_cache(PoolSpec(block_size=4, num_blocks=8, num_host_blocks=6))
    _finished(allocator, "s0", PROMPT, 0)
    # Three full pages are inserted, and written through: three host pages hold their copy, reusable (unpinned).
    assert allocator.host_pool.available_size() == 3 * 4
    assert sorted(allocator.host_free_blocks()) == list(range(6))
    assert len(allocator.cached_blocks()) == 3


def test_write_back_backs_up_only_what_the_device_evicts() -> None:
    allocator = hiradix_cache_write_back(PoolSpec(block_size=4, num_blocks=4, num_host_blocks=6))
    _finished(allocator, "s0", PROMPT, 0)
    assert allocator.host_pool.available_size() == 6 * 4  # nothing written yet
    _finished(allocator, "s1", OTHER, 1)  # needs every device page: the first prompt's pages are evicted
    assert allocator.host_pool.available_size() < 6 * 4
    assert sorted(allocator.host_free_blocks()) == list(range(6))


LONG = 8  # block size at which a three-page prompt's host hit (24 tokens) clears SGLang's 10-token load-back threshold
LONG_PROMPT = tuple(t for t in PROMPT[:12] for _ in (0, 1)) + (1,)  # three pages of eight tokens and one more
LONG_OTHER = tuple(t for t in OTHER[:12] for _ in (0, 1)) + (0,)


def _demoted(factory, engine: Engine) -> None:
    """``s0`` computes LONG_PROMPT and finishes; ``s1`` then needs every device page, so s0's pages leave the device
    for the host (demoted after their write-through, or backed up as they are evicted under write-back)."""
    for seq, tokens in (("s0", LONG_PROMPT), ("s1", LONG_OTHER)):
        assert engine.admit(seq, (), tokens)
        engine.step()
        engine.free(seq)


@pytest.mark.parametrize("factory", [hiradix_cache, hiradix_cache_write_back, hiradix_cache_rust])
def test_a_host_hit_is_loaded_back_and_read_through_kvfuzz_checks(factory) -> None:
    config = MachineConfig(block_size=LONG, num_blocks=4, num_host_blocks=6)
    engine = Engine(factory(config.pool_spec()), config)
    allocator = engine.allocator
    _demoted(factory, engine)
    stores = engine.stats["host-tier stores"]
    assert stores >= 3  # s0's three full pages reached the host, reported as stores
    assert engine.admit("s2", (), LONG_PROMPT)
    req = allocator._requests["s2"].req
    assert req.host_hit_length == 24 and req.host_loaded_length == 24  # SGLang loaded the three pages back ...
    table = engine.expected.seqs["s2"].table
    loads = [(host, block) for _, host, block in engine.host_tier.loads]
    assert [block for _, block in loads] == list(table[:3])  # ... into the first three blocks of s2's table
    assert engine.expected.seqs["s2"].written == 24  # reported cached: the next step computes one token
    engine.step()  # the loads land (their K/V checked against the reference), then s2 attends over them
    assert not engine.host_tier.loads and engine.stats["host-tier loads"] == 3
    engine.free("s2")
    engine.quiesce()


def test_write_through_stores_are_reported_at_the_next_launch() -> None:
    config = MachineConfig(block_size=4, num_blocks=8, num_host_blocks=6)
    allocator = hiradix_cache(config.pool_spec())
    engine = Engine(allocator, config)
    assert engine.admit("s0", (), PROMPT)
    engine.step()  # s0's three full pages are inserted as the step completes, and written through
    table = engine.expected.seqs["s0"].table
    transfers = allocator.take_transfers(1)
    assert [block for block, _ in transfers.stores] == list(table[:3]) and transfers.flushed == transfers.stores
    assert len({host for _, host in transfers.stores}) == 3


def test_write_back_stores_are_reported_when_the_device_evicts() -> None:
    config = MachineConfig(block_size=4, num_blocks=4, num_host_blocks=6)
    allocator = hiradix_cache_write_back(config.pool_spec())
    engine = Engine(allocator, config)
    assert engine.admit("s0", (), PROMPT)
    engine.step()
    table = engine.expected.seqs["s0"].table
    engine.free("s0")
    assert allocator.transfers.stores == []  # write-back: nothing copied while the pages stay on the device
    assert engine.admit("s1", (), OTHER)  # needs every device page: s0's are backed up as they are evicted
    assert sorted(block for block, _ in allocator.transfers.stores) == sorted(table[:3])
    engine.step()
    assert engine.stats["host-tier stores"] == 3


class _LoadsIntoTheNextBlock(SGLangHiCacheAllocator):
    """Reports each load-back's destination one block off (the next block of the table, cyclically)."""

    def admit(self, seq, namespace, tokens):
        result = super().admit(seq, namespace, tokens)
        loaded = [block for _, block in result.loads]
        shifted = [(host, loaded[(i + 1) % len(loaded)]) for i, (host, _) in enumerate(result.loads)]
        return attrs.evolve(result, loads=shifted)


def test_a_load_reported_into_the_wrong_block_is_caught() -> None:
    config = MachineConfig(block_size=LONG, num_blocks=4, num_host_blocks=6)
    engine = Engine(_LoadsIntoTheNextBlock(config.pool_spec()), config)
    _demoted(hiradix_cache, engine)
    assert engine.admit("s2", (), LONG_PROMPT)
    with pytest.raises(InvariantViolation) as caught:
        engine.step()
    assert caught.value.invariant is Invariant.CONTENT
    assert "loaded from host block" in caught.value.explain()


class _ForgetsStores(SGLangHiCacheAllocator):
    """Reports no store: the host pages SGLang backed up hold nothing kvfuzz copied."""

    def take_transfers(self, step):
        super().take_transfers(step)
        return HostTransfers()


def test_a_load_of_a_store_never_reported_is_caught() -> None:
    config = MachineConfig(block_size=LONG, num_blocks=4, num_host_blocks=6)
    engine = Engine(_ForgetsStores(config.pool_spec()), config)
    _demoted(hiradix_cache, engine)
    assert engine.admit("s2", (), LONG_PROMPT)
    with pytest.raises(InvariantViolation) as caught:
        engine.step()
    assert caught.value.invariant is Invariant.CONTENT


class _LeaksHostPages(SGLangHiCacheAllocator):
    """Takes a host page on every finish and never gives it back."""

    def free(self, seq) -> None:
        super().free(seq)
        self.host_pool.alloc(self.block_size)


def test_a_host_page_leak_is_caught_at_quiescence() -> None:
    config = MachineConfig(block_size=4, num_blocks=8, num_host_blocks=6)
    engine = Engine(_LeaksHostPages(config.pool_spec()), config)
    engine.admit("s0", (), PROMPT)
    engine.step()
    engine.free("s0")
    with pytest.raises(InvariantViolation) as caught:
        engine.quiesce()
    assert caught.value.invariant is Invariant.QUIESCENCE
    assert "host free set" in str(caught.value)


class _NoPollAfterFree(SGLangHiCacheAllocator):
    """Leaves the write-throughs a finish queues unacknowledged until the next step's event poll."""

    @in_context
    def free(self, seq) -> None:
        SGLangRadixAllocator.free.__wrapped__(self, seq)


def test_pages_held_by_an_unacknowledged_write_through_are_caught() -> None:
    """Why the adapter polls the events after a finish: until its write-through is acknowledged, SGLang keeps the
    finished prompt's pages locked; the adapter lists them pending (as it does a load-back's pages), but they were
    not released within an in-flight window (see the contract's second-tier gaps)."""
    config = MachineConfig(block_size=4, num_blocks=8, num_host_blocks=6)
    engine = Engine(_NoPollAfterFree(config.pool_spec()), config)
    engine.admit("s0", (), PROMPT)
    engine.step()  # the prompt's three full pages are checkpointed and written through at the step
    for token in (1, 2, 3):  # decode steps fill a fourth page, which only the finish inserts
        engine.grow("s0", (token,))
        engine.step()
    with pytest.raises(InvariantViolation) as caught:
        engine.free("s0")
    assert caught.value.invariant is Invariant.FREE_SET
    assert "pending, but only 0 were released within the in-flight window" in str(caught.value)


class _RustListsLockedPages(SGLangHiCacheRustAllocator):
    """Lists every device page in the tree as cached, locked or not."""

    def cached_blocks(self):
        slots = self.tree.tree_core.walk_for_kv_canary(False, False).slot_indices
        return [slot // self.block_size - 1 for slot in slots.tolist() if slot % self.block_size == 0]


def test_the_rust_core_walk_of_unlocked_nodes_is_what_keeps_locked_pages_out() -> None:
    config = MachineConfig(block_size=4, num_blocks=8, num_host_blocks=6)
    engine = Engine(_RustListsLockedPages(config.pool_spec()), config)
    engine.admit("s0", (), PROMPT)
    with pytest.raises(InvariantViolation) as caught:
        engine.step()  # checkpoints the prompt into the tree, where s0 still locks it
    assert caught.value.invariant is Invariant.FREE_SET
