"""``kvfuzz.allocator.PagedAllocator``'s out-of-blocks refusals are atomic, and the reserved-blocks watermark."""

from __future__ import annotations

import pytest
from factories import B, cached_tokens, check_counts, make, snapshot, toks

from kvfuzz.allocator import OutOfBlocks, PagedAllocator, Slot

# -- out-of-blocks refusals are atomic -----------------------------------------------------------------------------


def _crowded(window: int) -> PagedAllocator:
    """Six blocks: a referenced pair, a cached pair (W = 0) or pending pair (W = 1), and a free pair."""
    a = make(6, window=window, host=4)
    a.admit("keep", (), toks(0, B + 2))
    a.admit("gone", (), toks(100, 2 * B))
    a.step_completed(0)
    a.step_completed(1)
    a.free("gone")
    return a


@pytest.mark.parametrize("window", [0, 1])
def test_admit_out_of_blocks_changes_nothing(window: int) -> None:
    a = _crowded(window)
    before = snapshot(a, ["keep", "gone", "big"])
    with pytest.raises(OutOfBlocks):
        a.admit("big", (), toks(1000, 5 * B))
    assert snapshot(a, ["keep", "gone", "big"]) == before
    check_counts(a, {"keep": B + 2})
    # The cache survived: with W = 0 the freed blocks are still hits.
    if window == 0:
        assert cached_tokens(a, (), toks(100, 2 * B)) == 2 * B


def test_admit_counts_hits_on_evictable_blocks_as_unavailable() -> None:
    """Two cached blocks and one free: a prompt hitting both cached blocks and needing two more is refused (the
    hits cannot also be evicted for it), and the refusal keeps the cache; needing one more fits."""
    a = make(3)
    a.admit("a", (), toks(0, 2 * B))
    a.step_completed(0)
    a.free("a")
    before = snapshot(a, ["b"])
    with pytest.raises(OutOfBlocks) as caught:
        a.admit("b", (), toks(0, 2 * B) + toks(50, 2 * B))
    assert caught.value.needed == 2
    assert snapshot(a, ["b"]) == before
    result = a.admit("b", (), toks(0, 2 * B) + toks(50, B))
    assert result.num_cached_tokens == 2 * B
    check_counts(a, {"b": 3 * B})


@pytest.mark.parametrize("window", [0, 1])
def test_grow_out_of_blocks_changes_nothing(window: int) -> None:
    a = _crowded(window)
    a.admit("fill", (), toks(500, 2 * B if window else 4 * B))  # every free (and, W = 0, cached) block taken
    seqs = ["keep", "fill"]
    before = snapshot(a, seqs)
    with pytest.raises(OutOfBlocks):
        a.grow("keep", toks(900, B))  # needs a new block
    assert snapshot(a, seqs) == before
    # Space inside its own tail is still usable.
    result = a.grow("keep", (1, 2))
    assert result.slots == (Slot(before["tables"]["keep"][1], 2), Slot(before["tables"]["keep"][1], 3))


def test_grow_into_a_shared_tail_without_room_for_the_copy_changes_nothing() -> None:
    a = make(2)
    a.admit("p", (), toks(0, B + 1))
    a.fork("p", "c")
    before = snapshot(a, ["p", "c"])
    with pytest.raises(OutOfBlocks):
        a.grow("c", (3,))
    assert snapshot(a, ["p", "c"]) == before
    a.free("p")
    assert a.grow("c", (3,)).copies == ()


def test_reserved_blocks_watermark() -> None:
    a = make(4, reserved=1)
    before = snapshot(a, ["s"])
    with pytest.raises(OutOfBlocks):
        a.admit("s", (), toks(0, 4 * B))
    assert snapshot(a, ["s"]) == before
    a.admit("s", (), toks(0, 3 * B))
    check_counts(a, {"s": 3 * B})


def test_swap_in_respects_the_reserved_watermark() -> None:
    a = make(4, host=4, reserved=1)
    a.admit("s", (), toks(0, 2 * B))
    a.swap_out("s")
    a.admit("hog", (), toks(100, 2 * B))  # two blocks left: swap_in needs two plus the reserve
    before = snapshot(a, ["s", "hog"])
    with pytest.raises(OutOfBlocks):
        a.swap_in("s")
    assert snapshot(a, ["s", "hog"]) == before
    a.rollback("hog", B)  # three blocks left
    assert len(a.swap_in("s").mapping) == 2
