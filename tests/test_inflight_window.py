"""Unit tests of ``kvfuzz.allocator.PagedAllocator``'s in-flight window: released blocks stay pending until
the window closes.
"""

from __future__ import annotations

import pytest
from factories import B, check_counts, make, toks

from kvfuzz.allocator import OutOfBlocks

# -- the in-flight window ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize("last_completed", [-1, 3])
def test_released_blocks_wait_out_the_inflight_window(window: int, last_completed: int) -> None:
    a = make(4, window=window)
    if last_completed >= 0:
        for step in range(last_completed + 1):
            a.step_completed(step)
    table = a.admit("s", (), toks(0, B + 1)).block_table
    a.free("s")
    assert sorted(a.pending_blocks()) == sorted(table)
    assert not set(table) & set(a.free_blocks()) and not set(table) & set(a.cached_blocks())
    check_counts(a, {})

    # Not handed out before step last_completed + W completes: only the other two blocks can be allocated.
    with pytest.raises(OutOfBlocks):
        a.admit("big", (), toks(100, 3 * B))
    others = a.admit("other", (), toks(200, 2 * B)).block_table
    assert not set(others) & set(table)
    with pytest.raises(OutOfBlocks):
        a.admit("more", (), (1,))
    for step in range(last_completed + 1, last_completed + window):
        a.step_completed(step)
        assert sorted(a.pending_blocks()) == sorted(table), f"settled early at step {step}"
    a.step_completed(last_completed + window)
    assert not a.pending_blocks()
    assert set(table) <= set(a.free_blocks())
    assert set(a.admit("more", (), toks(300, 2 * B)).block_table) == set(table)
    check_counts(a, {"other": 2 * B, "more": 2 * B})


def test_with_window_zero_released_blocks_are_never_pending() -> None:
    a = make(4)
    table = a.admit("s", (), toks(0, B + 1)).block_table
    a.free("s")
    assert not a.pending_blocks()
    assert set(table) <= set(a.free_blocks())


def test_a_pending_cached_block_settles_into_the_cache() -> None:
    a = make(4, window=1)
    table = a.admit("s", (), toks(0, B + 1)).block_table
    a.step_completed(0)
    a.step_completed(1)  # block 0 committed
    a.free("s")  # pending until step 2
    assert sorted(a.pending_blocks()) == sorted(table)
    a.step_completed(2)
    assert list(a.cached_blocks()) == [table[0]]
    assert table[1] in a.free_blocks()


def test_a_pending_cached_block_can_be_hit_and_is_then_referenced_not_pending() -> None:
    a = make(4, window=1)
    table = a.admit("s", (), toks(0, B)).block_table
    a.step_completed(0)
    a.step_completed(1)
    a.free("s")
    assert list(a.pending_blocks()) == [table[0]]
    hit = a.admit("t", (), toks(0, B + 1))
    assert hit.num_cached_tokens == B and hit.block_table[0] == table[0]
    assert not a.pending_blocks()
    assert a.refcount(table[0]) == 1
    a.step_completed(2)  # the stale pending entry must not settle a referenced block
    assert table[0] not in a.free_blocks() and table[0] not in a.cached_blocks()
    check_counts(a, {"t": B + 1})
