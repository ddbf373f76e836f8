"""Unit tests of ``kvfuzz.allocator.PagedAllocator`` releasing blocks: free keeps full committed blocks cached,
allocation prefers free blocks and evicts least recently released first, evict and reset_cache.
"""

from __future__ import annotations

import pytest
from factories import B, cached_tokens, check_counts, make, toks

from kvfuzz.allocator import PagedAllocator

# -- free, eviction, reset ---------------------------------------------------------------------------------------


def test_free_keeps_full_committed_blocks_cached_and_frees_partial_ones() -> None:
    a = make(8)
    table = a.admit("s", (), toks(0, 2 * B + 1)).block_table
    a.step_completed(0)
    a.free("s")
    assert set(table[:2]) <= set(a.cached_blocks())
    assert table[2] in a.free_blocks()
    assert all(a.refcount(b) == 0 for b in table)
    assert not a.pending_blocks()
    check_counts(a, {})


def test_allocation_prefers_free_blocks_over_evicting_cached_ones() -> None:
    a = make(4)
    cached = a.admit("a", (), toks(0, 2 * B)).block_table
    a.step_completed(0)
    a.free("a")
    assert sorted(a.cached_blocks()) == sorted(cached)
    fresh = a.admit("b", (), toks(100, 2 * B)).block_table
    assert not set(fresh) & set(cached)
    assert sorted(a.cached_blocks()) == sorted(cached)
    assert cached_tokens(a, (), toks(0, 2 * B)) == 2 * B


def _cache_single_block_sequences(a: PagedAllocator, names: list[str], release_order: list[str]) -> dict[str, int]:
    blocks = {}
    for i, name in enumerate(names):
        (blocks[name],) = a.admit(name, (), toks(100 * (i + 1), B)).block_table
    a.step_completed(0)
    for name in release_order:
        a.free(name)
    return blocks


@pytest.mark.parametrize("release_order", [["x", "y", "z"], ["z", "x", "y"]])
def test_allocation_evicts_cached_blocks_least_recently_released_first(release_order: list[str]) -> None:
    a = make(3)
    blocks = _cache_single_block_sequences(a, ["x", "y", "z"], release_order)
    assert not a.free_blocks()
    for i, name in enumerate(release_order):
        (got,) = a.admit(f"new{i}", (), toks(5000 + 10 * i, 1)).block_table
        assert got == blocks[name]
        assert blocks[name] not in a.cached_blocks()
        assert set(a.cached_blocks()) == {blocks[n] for n in release_order[i + 1 :]}


def test_a_cache_hit_makes_a_block_most_recently_used() -> None:
    a = make(4)
    blocks = _cache_single_block_sequences(a, ["x", "y", "z"], ["x", "y", "z"])
    # Hits x's block (a hit never covers a whole prompt, so the prompt runs one token past it, into the free block).
    again = a.admit("again", (), toks(100, B) + (7,))
    assert again.num_cached_tokens == B and again.block_table[0] == blocks["x"]
    a.free("again")  # x is now the most recently released; the partial block is free, not cached
    order = [a.admit(f"n{i}", (), (9000 + i,)).block_table[0] for i in range(4)]
    assert order == [again.block_table[1], blocks["y"], blocks["z"], blocks["x"]]


def test_a_sequence_releases_its_tail_first() -> None:
    a = make(2)
    table = a.admit("s", (), toks(0, 2 * B)).block_table
    a.step_completed(0)
    a.free("s")
    (got,) = a.admit("n", (), (999,)).block_table
    assert got == table[1]
    assert list(a.cached_blocks()) == [table[0]]
    assert cached_tokens(a, (), toks(0, B)) == B


def test_evict_drops_lru_cached_blocks_and_returns_the_count() -> None:
    a = make(4)
    blocks = _cache_single_block_sequences(a, ["x", "y", "z"], ["x", "y", "z"])
    assert a.evict(0) == 0
    assert a.evict(2) == 2
    assert set(a.cached_blocks()) == {blocks["z"]}
    assert {blocks["x"], blocks["y"]} <= set(a.free_blocks())
    assert cached_tokens(a, (), toks(100, B)) == 0
    assert cached_tokens(a, (), toks(200, B)) == 0
    assert cached_tokens(a, (), toks(300, B)) == B
    assert a.evict(5) == 1
    assert not a.cached_blocks()
    assert a.evict(1) == 0
    check_counts(a, {})


def test_reset_cache_drops_unreferenced_cached_blocks_only() -> None:
    a = make(8)
    live = a.admit("live", (), toks(0, B)).block_table
    a.admit("gone", (), toks(100, 2 * B))
    a.step_completed(0)
    a.free("gone")
    assert len(a.cached_blocks()) == 2
    a.reset_cache()
    assert not a.cached_blocks()
    assert sorted(a.free_blocks()) == sorted(set(range(8)) - set(live))
    assert cached_tokens(a, (), toks(100, 2 * B)) == 0
    # A referenced block is not evicted; its cache entry stays true and matchable.
    assert a.refcount(live[0]) == 1
    assert cached_tokens(a, (), toks(0, B)) == B
    a.free("live")
    a.reset_cache()
    assert sorted(a.free_blocks()) == list(range(8))


def test_reset_cache_empties_a_pool_that_is_entirely_cached() -> None:
    a = make(4)
    a.admit("s", (), toks(0, 4 * B))
    a.step_completed(0)
    a.free("s")
    assert len(a.cached_blocks()) == 4 and not a.free_blocks()
    a.reset_cache()
    assert not a.cached_blocks()
    assert sorted(a.free_blocks()) == list(range(4))
    assert cached_tokens(a, (), toks(0, 4 * B)) == 0
