"""The HF transformers continuous-batching adapter: the machine against it, and direct checks of the mapping."""

from __future__ import annotations

import pytest
from hypothesis.stateful import run_state_machine_as_test

pytest.importorskip("transformers.generation.continuous_batching")

from kvfuzz.adapters.hf_transformers import (
    paged_attention_cache,
    paged_attention_cache_no_sharing,  # noqa: E402
    paged_attention_cache_two_block_sectors,
)
from kvfuzz.allocator import BlockCopy, OutOfBlocks, PoolSpec  # noqa: E402
from kvfuzz.profiles import PROFILES  # noqa: E402
from kvfuzz.statemachines import MachineConfig, machine_for  # noqa: E402

SPEC = PoolSpec(block_size=4, num_blocks=8)
PROMPT = (0, 1, 2, 3, 4, 5, 6, 7, 8)  # two full blocks and one token


@pytest.mark.parametrize(
    "factory",
    [
        pytest.param(paged_attention_cache, marks=pytest.mark.slow),
        pytest.param(paged_attention_cache_no_sharing, marks=pytest.mark.slow),
        paged_attention_cache_two_block_sectors,
    ],
    ids=lambda factory: factory.__name__,
)
def test_machine_passes_under_ci(factory) -> None:
    run_state_machine_as_test(machine_for(factory, MachineConfig()), settings=PROFILES["ci"])


@pytest.mark.parametrize("factory", [paged_attention_cache, paged_attention_cache_two_block_sectors])
def test_geometry_and_declared_capabilities(factory) -> None:
    cache = factory(SPEC)
    assert (cache.block_size, cache.num_blocks) == (4, 8)
    caps = cache.capabilities
    assert caps.prefix_cache and caps.eviction and caps.introspection and caps.fork and caps.remaps_on_step
    assert not (caps.swap or caps.rollback or caps.namespaces or caps.inflight_window)
    assert sorted(cache.free_blocks()) == list(range(8))


def test_a_shared_prefix_reports_cached_tokens_once_its_step_completed() -> None:
    cache = paged_attention_cache(SPEC)
    first = cache.admit("a", (), PROMPT)
    assert first.num_cached_tokens == 0
    assert cache.admit("early", (), PROMPT).num_cached_tokens == 0  # nothing is hashed before the step completes
    cache.free("early")
    cache.step_completed(0)
    second = cache.admit("b", (), PROMPT)
    assert second.num_cached_tokens == 8
    assert second.block_table[:2] == first.block_table[:2] and second.block_table[2] != first.block_table[2]
    assert [cache.refcount(block) for block in first.block_table] == [2, 2, 1]


def test_a_prefix_match_never_covers_the_whole_prompt() -> None:
    cache = paged_attention_cache(SPEC)
    cache.admit("a", (), PROMPT[:8])
    cache.step_completed(0)
    assert cache.admit("b", (), PROMPT[:8]).num_cached_tokens == 4


def test_a_duplicate_block_is_swapped_for_the_hashed_one_when_its_step_completes() -> None:
    """De-duplication remaps a running request's table at step completion (declared as remaps_on_step)."""
    cache = paged_attention_cache(SPEC)
    a, b = cache.admit("a", (), PROMPT[:5]), cache.admit("b", (), PROMPT[:5])
    assert a.block_table[0] != b.block_table[0]
    cache.step_completed(0)
    assert cache.block_table("b")[0] == a.block_table[0]
    assert cache.refcount(a.block_table[0]) == 2 and b.block_table[0] in cache.free_blocks()


def test_fork_copies_the_partial_block_and_shares_the_full_ones() -> None:
    cache = paged_attention_cache(SPEC)
    parent = cache.admit("p", (), PROMPT[:6]).block_table
    cache.step_completed(0)
    copies = cache.fork("p", "c")
    child = cache.block_table("c")
    assert child[0] == parent[0] and cache.refcount(parent[0]) == 2
    assert copies == (BlockCopy(src=parent[1], dst=child[1]),) and child[1] != parent[1]
    cache.step_completed(1)
    assert cache.fork("p", "d") == (BlockCopy(src=parent[1], dst=cache.block_table("d")[1]),)


def test_fork_of_whole_blocks_copies_nothing() -> None:
    cache = paged_attention_cache(SPEC)
    cache.admit("p", (), PROMPT[:8])
    cache.step_completed(0)
    assert cache.fork("p", "c") == ()
    assert cache.block_table("c") == cache.block_table("p")


def test_memory_pressure_evicts_the_cached_blocks() -> None:
    cache = paged_attention_cache(SPEC)
    cache.admit("a", (), PROMPT[:8])
    cache.admit("b", (), tuple(range(10, 34)))
    cache.step_completed(0)
    cache.free("a")
    assert len(cache.cached_blocks()) == 2 and not cache.free_blocks()
    assert len(cache.admit("c", (), (9, 9, 9, 9, 9)).block_table) == 2
    assert not cache.cached_blocks()


def test_a_refused_admission_hands_back_the_prefix_it_matched() -> None:
    cache = paged_attention_cache(SPEC)
    cache.admit("a", (), PROMPT[:8])
    cache.admit("b", (), tuple(range(10, 34)))
    cache.step_completed(0)
    cache.free("a")
    cached = sorted(cache.cached_blocks())
    with pytest.raises(OutOfBlocks):
        cache.admit("c", (), PROMPT[:4] + (9,) * 12)  # matches one cached block, then needs three more
    assert sorted(cache.cached_blocks()) == cached and [cache.refcount(block) for block in cached] == [0, 0]
    assert cache.admit("d", (), PROMPT[:5]).num_cached_tokens == 4


def test_preempt_drops_the_hashes_of_blocks_it_releases() -> None:
    cache = paged_attention_cache(SPEC)
    cache.admit("a", (), PROMPT)
    cache.step_completed(0)
    cache.preempt("a")
    assert not cache.cached_blocks() and len(cache.free_blocks()) == 8
    assert cache.admit("a", (), PROMPT).num_cached_tokens == 0
