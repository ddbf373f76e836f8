"""Unit tests of ``kvfuzz.allocator.PagedAllocator``'s swap_out and swap_in."""

from __future__ import annotations

import pytest
from factories import B, check_counts, make, snapshot, table_or_state, toks

from kvfuzz.allocator import Misuse, OutOfBlocks, Slot

# -- swap --------------------------------------------------------------------------------------------------------


def test_swap_out_and_in_round_trip() -> None:
    a = make(6, host=4)
    table = a.admit("s", (), toks(0, B + 2)).block_table
    a.step_completed(0)
    out = a.swap_out("s")
    assert [device for device, _ in out.mapping] == list(table)
    hosts = [host for _, host in out.mapping]
    assert len(set(hosts)) == 2 and all(0 <= h < 4 for h in hosts)
    assert all(a.refcount(b) == 0 for b in table)
    assert table_or_state(a, "s") == "swapped"
    check_counts(a, {})
    with pytest.raises(Misuse):
        a.grow("s", (1,))

    back = a.swap_in("s")
    assert [host for host, _ in back.mapping] == hosts
    device = [d for _, d in back.mapping]
    assert a.block_table("s") == tuple(device)
    assert all(a.refcount(b) == 1 for b in device)
    check_counts(a, {"s": B + 2})
    result = a.grow("s", (9,))
    assert result.slots == (Slot(device[1], 2),) and result.copies == ()


def test_swap_out_with_too_few_host_blocks_is_refused_and_changes_nothing() -> None:
    a = make(6, host=1)
    a.admit("s", (), toks(0, B + 1))
    a.admit("t", (), toks(100, 1))
    before = snapshot(a, ["s", "t"])
    with pytest.raises(OutOfBlocks):
        a.swap_out("s")
    assert snapshot(a, ["s", "t"]) == before
    # The host pool is intact: a one-block sequence still swaps out, and "s" still grows.
    a.swap_out("t")
    assert a.grow("s", (5,)).slots == (Slot(a.block_table("s")[1], 1),)


def test_swap_in_without_room_is_refused_and_changes_nothing() -> None:
    a = make(3, host=4)
    a.admit("s", (), toks(0, 2 * B))
    a.step_completed(0)
    a.swap_out("s")
    a.reset_cache()
    a.admit("hog", (), toks(100, 2 * B))
    before = snapshot(a, ["s", "hog"])
    with pytest.raises(OutOfBlocks):
        a.swap_in("s")
    assert snapshot(a, ["s", "hog"]) == before
    a.free("hog")
    a.swap_in("s")
    check_counts(a, {"s": 2 * B})


def test_freeing_a_swapped_out_sequence_returns_its_host_blocks() -> None:
    a = make(6, host=2)
    a.admit("s", (), toks(0, 2 * B))
    a.swap_out("s")
    a.free("s")
    assert table_or_state(a, "s") == "unknown"
    a.admit("t", (), toks(100, 2 * B))
    assert len(a.swap_out("t").mapping) == 2
