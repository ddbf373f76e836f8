"""Unit tests of kvfuzz's own correct allocator, ``kvfuzz.allocator.PagedAllocator``: admit on a cold cache,
grow, fork and copy-on-write.
"""

from __future__ import annotations

import pytest
from factories import B, check_counts, make, toks

from kvfuzz.allocator import Slot

# -- admit on a cold cache ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, B - 1, B, B + 1, 2 * B, 3 * B - 1])
def test_admit_cold_cache_allocates_ceil_n_over_b_blocks(n: int) -> None:
    a = make(8)
    result = a.admit("s", (), toks(100, n))
    assert len(result.block_table) == -(-n // B)
    assert len(set(result.block_table)) == len(result.block_table)
    assert result.num_cached_tokens == 0
    assert tuple(a.block_table("s")) == result.block_table
    for block in result.block_table:
        assert a.refcount(block) == 1
        assert block not in a.free_blocks()
    check_counts(a, {"s": n})


# -- grow --------------------------------------------------------------------------------------------------------


def test_grow_returns_the_slots_of_the_block_table() -> None:
    a = make(8)
    a.admit("s", (), toks(0, B + 1))
    length = B + 1
    for count in (1, 1, B + 3, 2 * B, 1):
        result = a.grow("s", toks(1000 + length, count))
        table = a.block_table("s")
        assert result.copies == ()
        assert len(result.slots) == count
        assert result.slots == tuple(Slot(table[p // B], p % B) for p in range(length, length + count))
        length += count
        assert len(table) == -(-length // B)
        check_counts(a, {"s": length})


def test_grow_keeps_the_existing_blocks() -> None:
    a = make(8)
    before = a.admit("s", (), toks(0, B + 2)).block_table
    a.grow("s", toks(10, 3 * B))
    assert a.block_table("s")[:2] == before


# -- fork and copy-on-write --------------------------------------------------------------------------------------


@pytest.mark.parametrize("first, second", [("p", "c"), ("c", "p")])
def test_fork_shares_blocks_and_the_first_write_into_a_shared_tail_copies_it(first: str, second: str) -> None:
    a = make(8)
    table = a.admit("p", (), toks(0, B + 2)).block_table
    a.step_completed(0)
    a.fork("p", "c")
    assert a.block_table("c") == table
    assert [a.refcount(b) for b in table] == [2, 2]
    check_counts(a, {"p": B + 2, "c": B + 2})

    result = a.grow(first, (77,))
    assert len(result.copies) == 1
    (cow,) = result.copies
    assert cow.src == table[1]
    assert cow.dst not in table
    assert a.block_table(first) == (table[0], cow.dst)
    assert a.block_table(second) == table
    assert result.slots == (Slot(cow.dst, 2),)
    assert a.refcount(table[0]) == 2 and a.refcount(table[1]) == 1 and a.refcount(cow.dst) == 1

    # The other branch now owns the original tail alone: it writes in place.
    result = a.grow(second, (88,))
    assert result.copies == ()
    assert result.slots == (Slot(table[1], 2),)
    check_counts(a, {"p": B + 3, "c": B + 3})


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    a = make(8)
    table = a.admit("p", (), toks(0, 2 * B)).block_table
    a.step_completed(0)
    a.fork("p", "c")
    for seq in ("p", "c"):
        result = a.grow(seq, (5,))
        assert result.copies == ()
        assert a.block_table(seq)[:2] == table
        assert a.block_table(seq)[2] not in table
    assert a.block_table("p")[2] != a.block_table("c")[2]
    assert [a.refcount(b) for b in table] == [2, 2]


def test_freeing_one_branch_of_a_fork_keeps_the_shared_blocks() -> None:
    a = make(8)
    table = a.admit("p", (), toks(0, B + 2)).block_table
    a.fork("p", "c")
    a.free("p")
    assert [a.refcount(b) for b in table] == [1, 1]
    assert a.grow("c", (1,)).copies == ()  # sole owner again, nothing cached: in place
    check_counts(a, {"c": B + 3})
