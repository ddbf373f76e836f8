"""SGLang's radix cache with its host tier (HiCache) behind kvfuzz's contract (kvfuzz.adapters.sglang.hicache).

Runs in SGLang's own environment (``scripts/third_party_env.sh sglang``; CI runs it there): without SGLang the
import fails loudly rather than skipping.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvfuzz.adapters.sglang._engine import in_context
from kvfuzz.adapters.sglang.hicache import (
    SGLangHiCacheAllocator,
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
    """Lets SGLang load host hits back and reports them as cached, as if kvfuzz had copied them into its pools."""

    @in_context
    def _build(self, spec: PoolSpec) -> None:
        SGLangHiCacheAllocator._build.__wrapped__(self, spec)
        self.tree.load_back_threshold = 1

    def _init_load_back(self, seq, req) -> None:
        tree = self.tree
        lock = tree.lock(req.last_node)
        try:
            from kvfuzz.adapters.sglang.hicache import hicache

            loaded, req.last_node = tree.init_load_back(
                hicache().InitLoadBackParams(
                    best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req
                )
            )
        finally:
            tree.unlock(lock)
        req.prefix_len += loaded
        req.kv.cache_protected_len = req.prefix_len
        self._loaded = loaded

    def _admit_req(self, seq, req, length):
        req.init_next_round_input(self.tree)
        self._loaded = 0
        if req.needs_host_load_back():
            self._init_load_back(seq, req)
        return SGLangHiCacheAllocator.__mro__[1]._admit_req(self, seq, req, length)


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
    assert engine.allocator._loaded == 12  # SGLang loaded the three host pages back
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
