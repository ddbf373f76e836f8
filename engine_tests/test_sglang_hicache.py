"""SGLang's radix cache with its host tier (HiCache) behind kvfuzz's contract (kvfuzz.adapters.sglang.hicache).

Runs in SGLang's own environment (``scripts/third_party_env.sh sglang``; CI runs it there): without SGLang the
import fails loudly rather than skipping.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvfuzz.adapters.sglang._engine import in_context
from kvfuzz.adapters.sglang.adapter import SGLangRadixAllocator
from kvfuzz.adapters.sglang.hicache import (
    SGLangHiCacheAllocator,
    SGLangHiCacheRustAllocator,
    hicache,
    hiradix_cache,
    hiradix_cache_rust,
    hiradix_cache_rust_write_back,
    hiradix_cache_write_back,
    hiradix_cache_write_through_selective,
)
from kvfuzz.allocator import PoolSpec
from kvfuzz.engine import Engine
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.profiles import PROFILES
from kvfuzz.statemachines import MachineConfig, machine_for

PROMPT = (1, 2, 3, 0, 2, 2, 1, 3, 0, 1, 2, 3, 3)  # three full pages of four tokens and one more
OTHER = (3, 1, 0, 2) * 3 + (1,)  # as long, nothing in common with PROMPT


HOST_TIER = MachineConfig(block_size=4, num_blocks=6, num_host_blocks=12)
"""A device pool small enough that cached prefixes leave it for the host, and a host pool twice its size."""


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


def test_a_prefix_demoted_to_the_host_is_matched_there_and_recomputed() -> None:
    allocator = hiradix_cache(PoolSpec(block_size=4, num_blocks=4, num_host_blocks=6))
    _finished(allocator, "s0", PROMPT, 0)
    _finished(allocator, "s1", OTHER, 1)  # evicts the first prompt from the device; its host copy stays
    admitted = allocator.admit("s2", (), PROMPT)
    req = allocator._requests["s2"].req
    assert req.host_hit_length == 12  # SGLang found three pages on the host ...
    assert admitted.num_cached_tokens == 0  # ... declined to load them back, and recomputes them
    allocator.step_completed(2)
    allocator.free("s2")
    assert sorted(allocator.host_free_blocks()) == list(range(6))


class _LoadsBack(SGLangHiCacheAllocator):
    """Lets SGLang load host hits back (its own 10-token threshold lowered to one), as if kvfuzz had copied the
    loaded K/V into its pools: the admission then matches the loaded pages on the device and reports them cached."""

    @in_context
    def _build(self, spec: PoolSpec) -> None:
        SGLangHiCacheAllocator._build.__wrapped__(self, spec)
        self.tree.load_back_threshold = 1

    def _init_load_back(self, seq, req) -> None:
        lock = self.tree.lock(req.last_node)
        try:
            self.loaded, _ = self.tree.init_load_back(
                hicache().InitLoadBackParams(
                    best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req
                )
            )
        finally:
            self.tree.unlock(lock)


def test_a_load_back_reported_as_a_hit_is_caught() -> None:
    """What declining load-back keeps out: a hit on pages whose K/V only the host copy holds, which kvfuzz's pools
    never received (no contract call carries the copy)."""
    config = MachineConfig(block_size=4, num_blocks=4, num_host_blocks=6)
    engine = Engine(_LoadsBack(config.pool_spec()), config)
    for seq, tokens in (("s0", PROMPT), ("s1", OTHER)):
        engine.admit(seq, (), tokens)
        engine.step()
        engine.free(seq)
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("s2", (), PROMPT)
    assert engine.allocator.loaded == 12  # SGLang loaded the three host pages back
    assert caught.value.invariant is Invariant.CACHE_SOUNDNESS


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
    finished prompt's pages locked, in none of the sets the contract has (see the contract's second-tier gaps)."""
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
    assert "none of the free, cached and pending sets" in str(caught.value)


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
