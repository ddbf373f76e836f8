"""Unit tests of ``kvfuzz.allocator.PagedAllocator``'s rollback."""

from __future__ import annotations

import copy

import pytest
from factories import B, cached_tokens, check_counts, make, toks

from kvfuzz.allocator import BlockCopy, Slot

# -- rollback ----------------------------------------------------------------------------------------------------


def test_rollback_releases_blocks_past_the_new_length() -> None:
    a = make(8)
    table = a.admit("s", (), toks(0, 2 * B + 2)).block_table
    a.rollback("s", B)  # 2B+2 -> B+2: block 2 goes
    assert a.block_table("s") == table[:2]
    assert a.refcount(table[2]) == 0 and table[2] in a.free_blocks()
    check_counts(a, {"s": B + 2})
    result = a.grow("s", (1,))
    assert result.slots == (Slot(table[1], 2),) and result.copies == ()


@pytest.mark.parametrize("n", [2, B, B + 1, 3 * B])
def test_rollback_keeps_at_least_one_token(n: int) -> None:
    a = make(8)
    table = a.admit("s", (), toks(0, n)).block_table
    a.rollback("s", n - 1)
    assert a.block_table("s") == table[:1]
    check_counts(a, {"s": 1})
    assert a.grow("s", (5,)).slots == (Slot(table[0], 1),)


def test_rollback_into_a_cached_full_block_then_grow_copies_it() -> None:
    a = make(8)
    prompt = toks(0, 2 * B)
    table = a.admit("s", (), prompt).block_table
    a.step_completed(0)
    a.rollback("s", 2)
    assert a.block_table("s") == table
    result = a.grow("s", (901,))
    assert len(result.copies) == 1
    assert result.copies[0] == BlockCopy(src=table[1], dst=result.copies[0].dst)
    dst = result.copies[0].dst
    assert dst not in table
    assert a.block_table("s") == (table[0], dst)
    assert result.slots == (Slot(dst, B - 2),)
    # The cached block was not written and stays matchable for the original prefix.
    assert a.refcount(table[1]) == 0 and table[1] in a.cached_blocks()
    hit = copy.deepcopy(a).admit("again", (), prompt + (7,))
    assert hit.num_cached_tokens == 2 * B and hit.block_table[:2] == table
    check_counts(a, {"s": 2 * B - 1})


def test_rollback_into_a_cached_block_and_regrowing_the_same_tokens_still_copies() -> None:
    a = make(8)
    prompt = toks(0, 2 * B)
    table = a.admit("s", (), prompt).block_table
    a.step_completed(0)
    a.rollback("s", 1)
    result = a.grow("s", prompt[-1:])
    assert [c.src for c in result.copies] == [table[1]]


def test_rollback_to_a_block_boundary_then_grow_takes_a_new_block() -> None:
    a = make(8)
    table = a.admit("s", (), toks(0, 2 * B)).block_table
    a.step_completed(0)
    a.rollback("s", B)
    assert a.block_table("s") == table[:1]
    assert table[1] in a.cached_blocks()
    result = a.grow("s", (5,))
    assert result.copies == ()
    new = a.block_table("s")[1]
    assert new != table[1] and result.slots == (Slot(new, 0),)
    assert table[1] in a.cached_blocks()  # a free block was available: the cached one was not evicted


def test_a_stale_registration_after_rollback_does_not_make_new_content_matchable() -> None:
    """Block 1 is filled, rolled back and refilled with other tokens before the first fill's step completes."""
    a = make(8)
    prompt = toks(0, 2 * B)
    table = a.admit("s", (), prompt).block_table
    a.rollback("s", 2)
    a.grow("s", (700, 701))  # not cached yet: written in place
    assert a.block_table("s") == table
    a.step_completed(0)
    assert cached_tokens(a, (), prompt) == B
    assert cached_tokens(a, (), prompt[:-2] + (700, 701)) == 2 * B
