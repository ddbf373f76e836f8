"""Unit tests of ``kvfuzz.allocator.PagedAllocator``'s prefix cache: when a block becomes a hit (the commit
rule), and which prompts and namespaces hit it.
"""

from __future__ import annotations

import pytest
from factories import B, cached_tokens, check_counts, make, toks

from kvfuzz.allocator import Slot

# -- admit and the prefix cache ----------------------------------------------------------------------------------


def test_full_blocks_hit_only_after_their_step_completes_w0() -> None:
    a = make(12)
    prompt = toks(0, 2 * B + 2)
    first = a.admit("a", (), prompt).block_table
    # Written by step 0, which has not completed: no hit yet.
    assert a.admit("early", (), prompt).num_cached_tokens == 0
    a.free("early")
    a.step_completed(0)
    hit = a.admit("b", (), prompt)
    assert hit.num_cached_tokens == 2 * B
    assert hit.block_table[:2] == first[:2]
    assert hit.block_table[2] != first[2]  # the partial tail is never shared through the cache
    assert a.refcount(first[0]) == 2 and a.refcount(first[1]) == 2 and a.refcount(first[2]) == 1
    check_counts(a, {"a": len(prompt), "b": len(prompt)})


def test_commit_rule_with_inflight_window_one() -> None:
    """With W = 1, work scheduled while step c is the last completed lands in step c + 2 (``_commit_step``)."""
    a = make(16, window=1)
    prompt = toks(0, 2 * B)
    a.admit("a", (), prompt)  # last completed -1: committed once step 1 completes
    a.step_completed(0)
    assert cached_tokens(a, (), prompt) == 0
    a.step_completed(1)
    assert cached_tokens(a, (), prompt) == 2 * B

    # A block filled by a grow scheduled after step 5 completed is matchable after step 7, not step 6.
    a.admit("g", (), toks(50, B - 1))
    a.step_completed(5)
    assert a.grow("g", (99,)).copies == ()
    full = toks(50, B - 1) + (99,)
    a.step_completed(6)
    assert cached_tokens(a, (), full) == 0
    a.step_completed(7)
    assert cached_tokens(a, (), full) == B


def test_blocks_of_a_sequence_freed_before_its_step_completes_never_become_hits() -> None:
    a = make(8)
    prompt = toks(0, 2 * B)
    a.admit("a", (), prompt)
    a.free("a")
    a.step_completed(0)
    assert cached_tokens(a, (), prompt) == 0
    assert not a.cached_blocks()


@pytest.mark.parametrize(
    "ns1, ns2",
    [
        (("ab", "c"), ("a", "bc")),
        (("x",), ("x", "")),
        ((), ("",)),
        (("lora-1",), ("lora-2",)),
        (("lora-1", "salt"), ("salt", "lora-1")),
    ],
)
def test_hits_require_namespaces_equal_part_for_part(ns1, ns2) -> None:
    a = make(12)
    prompt = toks(0, 2 * B)
    a.admit("a", ns1, prompt)
    a.step_completed(0)
    assert cached_tokens(a, ns2, prompt) == 0
    assert cached_tokens(a, ns1, prompt) == 2 * B
    assert cached_tokens(a, tuple(ns1), list(prompt)) == 2 * B


def test_hits_require_the_whole_token_prefix_to_be_equal() -> None:
    a = make(16)
    prompt = toks(0, 3 * B)
    a.admit("a", (), prompt)
    a.step_completed(0)
    assert cached_tokens(a, (), prompt) == 3 * B
    # A different token in block 1: block 0 still hits, blocks 1 and 2 do not (the hash is chained).
    changed = list(prompt)
    changed[B + 1] = 999
    assert cached_tokens(a, (), changed) == B
    # A different first token: nothing hits, although blocks 1 and 2 hold the same tokens.
    changed = list(prompt)
    changed[0] = 999
    assert cached_tokens(a, (), changed) == 0
    # A longer prompt with the same prefix: the three cached blocks hit.
    assert cached_tokens(a, (), prompt + toks(500, B + 1)) == 3 * B
    # A shorter one: only its full blocks can hit.
    assert cached_tokens(a, (), prompt[: 2 * B + 3]) == 2 * B


def test_partial_blocks_are_never_hits() -> None:
    a = make(8)
    a.admit("short", (), toks(0, B - 1))
    a.admit("long", (), toks(100, B + 2))
    a.step_completed(0)
    a.step_completed(1)
    assert cached_tokens(a, (), toks(0, B - 1)) == 0
    assert cached_tokens(a, (), toks(100, B + 2)) == B
    a.free("short")
    a.free("long")
    assert cached_tokens(a, (), toks(0, B - 1)) == 0


def test_a_fully_cached_prompt_recomputes_its_last_block_into_a_fresh_one() -> None:
    """A hit never covers the whole prompt: the last token's query is needed, so the last block's hit is given up
    and that block is recomputed into a fresh block; the cached one is left as it is."""
    a = make(8)
    prompt = toks(0, 2 * B)
    first = a.admit("a", (), prompt).block_table
    a.step_completed(0)
    second = a.admit("b", (), prompt)
    assert second.num_cached_tokens == B and second.block_table[0] == first[0]
    assert second.block_table[1] not in first
    grown = a.grow("b", (7,))
    assert grown.copies == ()
    assert grown.slots == (Slot(a.block_table("b")[2], 0),)
    assert a.block_table("b")[2] not in first
    check_counts(a, {"a": 2 * B, "b": 2 * B + 1})


def test_without_prefix_caching_nothing_ever_hits() -> None:
    a = make(8, prefix_caching=False)
    prompt = toks(0, 2 * B)
    a.admit("a", (), prompt)
    a.step_completed(0)
    assert cached_tokens(a, (), prompt) == 0
    a.free("a")
    assert not a.cached_blocks()
    assert sorted(a.free_blocks()) == list(range(8))
