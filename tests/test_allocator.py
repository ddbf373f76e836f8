"""Unit tests of kvfuzz's own correct allocator, ``kvfuzz.allocator.PagedAllocator``, driven by hand.

Each test sets up a few blocks, makes one claim about the contract (or about this allocator's documented policy:
free before evict, LRU eviction, the commit rule) and checks it through the public and introspection methods. The
helpers at the top take snapshots of the observable state so that refusals can be shown to change nothing.
"""

from __future__ import annotations

import copy
import random
from typing import Callable

import pytest

from kvfuzz.allocator import (
    BlockCopy,
    InvalidArgument,
    Misuse,
    OutOfBlocks,
    PagedAllocator,
    SequenceExists,
    Slot,
    UnknownSequence,
)

B = 4  # block size of every allocator in this file unless a test says otherwise


def make(
    num_blocks: int = 8,
    *,
    window: int = 0,
    host: int = 0,
    block_size: int = B,
    prefix_caching: bool = True,
    reserved: int = 0,
) -> PagedAllocator:
    return PagedAllocator(
        block_size, num_blocks, host, inflight_window=window, prefix_caching=prefix_caching, reserved_blocks=reserved
    )


def toks(start: int, count: int) -> tuple[int, ...]:
    """``count`` distinct tokens starting at ``start``."""
    return tuple(range(start, start + count))


# -- helpers: snapshots and the counts identity --------------------------------------------------------------------


def table_or_state(a: PagedAllocator, seq: str):
    try:
        return tuple(a.block_table(seq))
    except UnknownSequence:
        return "unknown"
    except InvalidArgument:
        return "swapped"


def snapshot(a: PagedAllocator, seqs=()) -> dict:
    """Everything observable about the device pool, and the tables (or state) of ``seqs``."""
    return {
        "free": sorted(a.free_blocks()),
        "cached": sorted(a.cached_blocks()),
        "pending": sorted(a.pending_blocks()),
        "refcounts": [a.refcount(b) for b in range(a.num_blocks)],
        "tables": {seq: table_or_state(a, seq) for seq in seqs},
    }


def cached_tokens(a: PagedAllocator, namespace, tokens) -> int:
    """How many tokens a fresh admit of ``tokens`` would find cached, asked of a deep copy (``a`` is untouched)."""
    probe = copy.deepcopy(a)
    return probe.admit("__probe__", namespace, tokens).num_cached_tokens


def check_counts(a: PagedAllocator, running: dict[str, int] | None = None) -> None:
    """free + cached + pending + referenced == num_blocks, the sets disjoint and duplicate-free.

    ``running`` maps each running sequence to its token count; if given, refcounts must equal the number of
    block-table entries naming each block, and each table must hold ceil(n / block_size) blocks.
    """
    free, cached, pending = list(a.free_blocks()), list(a.cached_blocks()), list(a.pending_blocks())
    referenced = [b for b in range(a.num_blocks) if a.refcount(b) > 0]
    assert len(set(free)) == len(free) and len(set(cached)) == len(cached) and len(set(pending)) == len(pending)
    assert all(a.refcount(b) >= 0 for b in range(a.num_blocks))
    groups = [set(free), set(cached), set(pending), set(referenced)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not groups[i] & groups[j], f"block sets {i} and {j} overlap: {groups[i] & groups[j]}"
    assert len(free) + len(cached) + len(pending) + len(referenced) == a.num_blocks
    if running is not None:
        uses = [0] * a.num_blocks
        for seq, length in running.items():
            table = a.block_table(seq)
            assert len(table) == -(-length // a.block_size)
            for block in table:
                uses[block] += 1
        assert uses == [a.refcount(b) for b in range(a.num_blocks)]


# -- admit and the prefix cache ----------------------------------------------------------------------------------


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


def test_full_prompt_hit_reports_every_token_and_the_next_grow_takes_a_new_block() -> None:
    a = make(8)
    prompt = toks(0, 2 * B)
    first = a.admit("a", (), prompt).block_table
    a.step_completed(0)
    second = a.admit("b", (), prompt)
    assert second.num_cached_tokens == 2 * B and second.block_table == first
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
    a = make(3)
    blocks = _cache_single_block_sequences(a, ["x", "y", "z"], ["x", "y", "z"])
    a.admit("again", (), toks(100, B))  # hits x's block
    a.free("again")  # x is now the most recently released
    order = [a.admit(f"n{i}", (), (9000 + i,)).block_table[0] for i in range(3)]
    assert order == [blocks["y"], blocks["z"], blocks["x"]]


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
    hit = copy.deepcopy(a).admit("again", (), prompt)
    assert hit.num_cached_tokens == 2 * B and hit.block_table == table
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


# -- misuse: typed errors, nothing changed --------------------------------------------------------------------------

SEQS = ["run", "fork", "swapped", "dead", "nope"]


def _misuse_state() -> PagedAllocator:
    """W = 1 with a running sequence and its fork, a swapped one, a freed one, pending blocks, cached blocks and
    registrations still in flight."""
    a = make(12, window=1, host=4)
    a.admit("run", ("ns",), toks(0, B + 2))
    a.admit("swapped", (), toks(100, B))
    a.admit("dead", (), toks(200, 2 * B))
    a.step_completed(0)
    a.step_completed(1)
    a.fork("run", "fork")
    a.swap_out("swapped")
    a.free("dead")
    a.admit("late", (), toks(300, 2 * B))  # registration pending
    return a


MISUSES: list[tuple[str, Callable[[PagedAllocator], object], type]] = [
    ("grow unknown", lambda a: a.grow("nope", (1,)), UnknownSequence),
    ("grow freed", lambda a: a.grow("dead", (1,)), UnknownSequence),
    ("grow swapped", lambda a: a.grow("swapped", (1,)), Misuse),
    ("grow no tokens", lambda a: a.grow("run", ()), InvalidArgument),
    ("free unknown", lambda a: a.free("nope"), UnknownSequence),
    ("double free", lambda a: a.free("dead"), UnknownSequence),
    ("preempt unknown", lambda a: a.preempt("nope"), UnknownSequence),
    ("preempt freed", lambda a: a.preempt("dead"), UnknownSequence),
    ("preempt swapped", lambda a: a.preempt("swapped"), Misuse),
    ("admit live id", lambda a: a.admit("run", (), (1, 2)), SequenceExists),
    ("admit swapped id", lambda a: a.admit("swapped", (), (1, 2)), SequenceExists),
    ("admit empty", lambda a: a.admit("new", (), ()), InvalidArgument),
    ("fork onto live id", lambda a: a.fork("run", "fork"), SequenceExists),
    ("fork onto swapped id", lambda a: a.fork("run", "swapped"), SequenceExists),
    ("fork onto itself", lambda a: a.fork("run", "run"), SequenceExists),
    ("fork unknown parent", lambda a: a.fork("nope", "new"), UnknownSequence),
    ("fork freed parent", lambda a: a.fork("dead", "new"), UnknownSequence),
    ("fork swapped parent", lambda a: a.fork("swapped", "new"), Misuse),
    ("rollback all tokens", lambda a: a.rollback("run", B + 2), InvalidArgument),
    ("rollback too many", lambda a: a.rollback("run", B + 3), InvalidArgument),
    ("rollback zero", lambda a: a.rollback("run", 0), InvalidArgument),
    ("rollback negative", lambda a: a.rollback("run", -1), InvalidArgument),
    ("rollback unknown", lambda a: a.rollback("nope", 1), UnknownSequence),
    ("rollback swapped", lambda a: a.rollback("swapped", 1), Misuse),
    ("swap_in running", lambda a: a.swap_in("run"), InvalidArgument),
    ("swap_in unknown", lambda a: a.swap_in("nope"), Misuse),
    ("swap_in freed", lambda a: a.swap_in("dead"), Misuse),
    ("swap_out swapped", lambda a: a.swap_out("swapped"), Misuse),
    ("swap_out unknown", lambda a: a.swap_out("nope"), UnknownSequence),
    ("step_completed repeated", lambda a: a.step_completed(1), InvalidArgument),
    ("step_completed backwards", lambda a: a.step_completed(0), InvalidArgument),
    ("step_completed far back", lambda a: a.step_completed(-5), InvalidArgument),
    ("evict negative", lambda a: a.evict(-1), InvalidArgument),
    ("block_table unknown", lambda a: a.block_table("nope"), UnknownSequence),
]


@pytest.mark.parametrize("call, error", [(c, e) for _, c, e in MISUSES], ids=[name for name, _, _ in MISUSES])
def test_misuse_raises_a_typed_error_and_changes_nothing(call, error) -> None:
    a = _misuse_state()
    reference = _misuse_state()
    before = snapshot(a, SEQS)
    assert before == snapshot(reference, SEQS)
    with pytest.raises(error) as caught:
        call(a)
    assert isinstance(caught.value, Misuse)
    assert snapshot(a, SEQS) == before
    # And nothing hidden changed: the same continuation gives the same results as on an untouched allocator.
    assert _continuation(a) == _continuation(reference)


def _continuation(a: PagedAllocator) -> list:
    results = []
    results.append(a.grow("run", (7,)))
    results.append(a.grow("fork", (8,)))
    results.append(a.swap_in("swapped"))
    for step in (2, 3):
        a.step_completed(step)
        results.append(snapshot(a, SEQS + ["late"]))
    results.append(a.admit("probe1", (), toks(300, 2 * B)))
    results.append(a.admit("probe2", (), toks(200, 2 * B)))
    results.append(a.admit("probe3", ("ns",), toks(0, B + 2)))
    results.append(a.evict(100))
    results.append(snapshot(a, SEQS + ["late", "probe1", "probe2", "probe3"]))
    return results


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


# -- the counts identity over mixed operations -----------------------------------------------------------------------


def test_counts_identity_after_a_mixed_sequence_of_operations() -> None:
    a = make(10, window=1, host=4)
    running: dict[str, int] = {}

    def step(n: int) -> None:
        a.step_completed(n)
        check_counts(a, running)

    a.admit("a", (), toks(0, 2 * B + 1))
    running["a"] = 2 * B + 1
    check_counts(a, running)
    a.admit("b", ("x",), toks(0, B))
    running["b"] = B
    check_counts(a, running)
    step(0)
    step(1)
    a.fork("a", "a2")
    running["a2"] = running["a"]
    check_counts(a, running)
    a.grow("a2", (5, 6))
    running["a2"] += 2
    check_counts(a, running)
    a.admit("c", (), toks(0, 2 * B + 3))
    running["c"] = 2 * B + 3
    check_counts(a, running)
    a.rollback("a", B + 2)
    running["a"] -= B + 2
    check_counts(a, running)
    a.swap_out("b")
    del running["b"]
    check_counts(a, running)
    step(2)
    a.free("c")
    del running["c"]
    check_counts(a, running)
    a.preempt("a2")
    del running["a2"]
    check_counts(a, running)
    a.swap_in("b")
    running["b"] = B
    check_counts(a, running)
    a.evict(1)
    check_counts(a, running)
    step(3)
    a.grow("a", toks(40, 3 * B))
    running["a"] += 3 * B
    check_counts(a, running)
    with pytest.raises(OutOfBlocks):
        a.admit("huge", (), toks(0, 20 * B))
    check_counts(a, running)
    a.reset_cache()
    check_counts(a, running)
    for seq in list(running):
        a.free(seq)
        del running[seq]
        check_counts(a, running)
    step(4)
    step(5)
    a.reset_cache()
    assert sorted(a.free_blocks()) == list(range(10)), "quiescence: every block free"


# -- a small seeded random driver: content, exclusive writes, window, atomic refusals --------------------------------


class _Driver:
    """Plays a simple engine against the allocator with writes applied at once, checking after every call:
    the content of every position of every running sequence (a shadow of (namespace, prefix) per slot), that every
    write goes to a block referenced once, that no block is written before its release window closed, that refusals
    change nothing, and the counts identity."""

    NAMESPACES = [(), ("a",), ("ab", "c"), ("a", "bc")]
    PROMPTS = [toks(0, 2 * B), toks(0, B) + toks(50, B), toks(100, 3 * B)]

    def __init__(self, a: PagedAllocator, rng: random.Random) -> None:
        self.a, self.rng = a, rng
        self.window = a.capabilities.inflight_window
        self.seqs: dict[str, tuple] = {}  # running: (namespace, tokens)
        self.swapped: dict[str, tuple] = {}  # (namespace, tokens, host blocks)
        self.shadow: dict[tuple[int, int], tuple] = {}
        self.host_shadow: dict[tuple[int, int], tuple] = {}
        self.released_at: dict[int, int] = {}
        self.last = -1
        self.counter = 0
        self.stats = {"hits": 0, "copies": 0, "refusals": 0}

    # writes -------------------------------------------------------------------------------------------------------

    def write(self, seq: str, block: int, offset: int, value: tuple) -> None:
        a = self.a
        assert a.refcount(block) == 1, f"{seq} writes to block {block} held {a.refcount(block)} times"
        if block in self.released_at:
            assert self.last >= self.released_at[block] + self.window, (
                f"block {block} released after step {self.released_at[block]} written after step {self.last}"
            )
        self.shadow[(block, offset)] = value

    def write_positions(self, seq: str, start: int) -> None:
        namespace, tokens = self.seqs[seq]
        table = self.a.block_table(seq)
        for p in range(start, len(tokens)):
            self.write(seq, table[p // B], p % B, (namespace, tokens[: p + 1]))

    def copy_block(self, src: int, dst: int, shadow_src: dict, shadow_dst: dict) -> None:
        for offset in range(B):
            if (src, offset) in shadow_src:
                shadow_dst[(dst, offset)] = shadow_src[(src, offset)]
            else:
                shadow_dst.pop((dst, offset), None)

    # checks -------------------------------------------------------------------------------------------------------

    def check(self) -> None:
        check_counts(self.a, {seq: len(tokens) for seq, (_, tokens) in self.seqs.items()})
        for seq, (namespace, tokens) in self.seqs.items():
            table = self.a.block_table(seq)
            for p in range(len(tokens)):
                got = self.shadow.get((table[p // B], p % B))
                assert got == (namespace, tokens[: p + 1]), f"{seq} position {p} holds {got}"

    # operations -----------------------------------------------------------------------------------------------------

    def op(self) -> None:
        a, rng = self.a, self.rng
        weights = {
            "admit": 4,
            "grow": 3,
            "step": 3,
            "free": 2,
            "fork": 1.5,
            "rollback": 1,
            "preempt": 1,
            "swap_out": 1,
            "swap_in": 1,
            "evict": 0.5,
            "reset": 0.2,
        }
        (kind,) = rng.choices(list(weights), weights=list(weights.values()))
        running = sorted(self.seqs)
        before = snapshot(a, running + sorted(self.swapped))
        refs_before = [a.refcount(b) for b in range(a.num_blocks)]
        try:
            self.apply(kind, running)
        except OutOfBlocks:
            self.stats["refusals"] += 1
            assert snapshot(a, running + sorted(self.swapped)) == before
        for b in range(a.num_blocks):
            if refs_before[b] > 0 and a.refcount(b) == 0:
                self.released_at[b] = self.last
        self.check()

    def apply(self, kind: str, running: list[str]) -> None:
        a, rng = self.a, self.rng
        if kind == "admit":
            seq = f"s{self.counter}"
            self.counter += 1
            namespace = rng.choice(self.NAMESPACES)
            cut = rng.choice([B, 2 * B, 3 * B, rng.randint(1, 3 * B)])
            tokens = rng.choice(self.PROMPTS)[:cut] + toks(1000, rng.randint(0, B + 1))
            result = a.admit(seq, namespace, tokens)
            assert result.num_cached_tokens % B == 0 and result.num_cached_tokens <= len(tokens)
            assert len(result.block_table) == -(-len(tokens) // B)
            self.stats["hits"] += result.num_cached_tokens
            self.seqs[seq] = (namespace, tokens)
            self.write_positions(seq, result.num_cached_tokens)
        elif kind == "grow" and running:
            seq = rng.choice(running)
            namespace, tokens = self.seqs[seq]
            if len(tokens) > 4 * B:  # keep sequences short so that the pool turns over
                a.free(seq)
                del self.seqs[seq]
                return
            new = tuple(rng.randint(0, 3) for _ in range(rng.randint(1, B + 2)))
            result = a.grow(seq, new)
            for cow in result.copies:
                self.copy_block(cow.src, cow.dst, self.shadow, self.shadow)
                self.stats["copies"] += 1
            self.seqs[seq] = (namespace, tokens + new)
            table = a.block_table(seq)
            assert result.slots == tuple(Slot(table[p // B], p % B) for p in range(len(tokens), len(tokens) + len(new)))
            for cow in result.copies:
                assert a.refcount(cow.dst) == 1 and cow.dst in table
            self.write_positions(seq, len(tokens))
        elif kind == "step":
            self.last += 1
            a.step_completed(self.last)
        elif kind == "free" and (running or self.swapped):
            seq = rng.choice(running + sorted(self.swapped))
            a.free(seq)
            self.seqs.pop(seq, None)
            self.swapped.pop(seq, None)
        elif kind == "preempt" and running:
            seq = rng.choice(running)
            a.preempt(seq)
            del self.seqs[seq]
        elif kind == "fork" and running:
            parent = rng.choice(running)
            child = f"s{self.counter}"
            self.counter += 1
            a.fork(parent, child)
            self.seqs[child] = self.seqs[parent]
            assert a.block_table(child) == a.block_table(parent)
        elif kind == "rollback" and running:
            seq = rng.choice(running)
            namespace, tokens = self.seqs[seq]
            if len(tokens) > 1:
                k = rng.randint(1, min(len(tokens) - 1, B + 2))
                a.rollback(seq, k)
                self.seqs[seq] = (namespace, tokens[:-k])
        elif kind == "swap_out" and running:
            seq = rng.choice(running)
            table = a.block_table(seq)
            result = a.swap_out(seq)
            assert tuple(d for d, _ in result.mapping) == tuple(table)
            assert len({h for _, h in result.mapping}) == len(table)
            for device, host in result.mapping:
                self.copy_block(device, host, self.shadow, self.host_shadow)
            namespace, tokens = self.seqs.pop(seq)
            self.swapped[seq] = (namespace, tokens, [h for _, h in result.mapping])
        elif kind == "swap_in" and self.swapped:
            seq = rng.choice(sorted(self.swapped))
            namespace, tokens, hosts = self.swapped[seq]
            result = a.swap_in(seq)
            assert [h for h, _ in result.mapping] == hosts
            del self.swapped[seq]
            self.seqs[seq] = (namespace, tokens)
            for host, device in result.mapping:
                assert a.refcount(device) == 1
                if device in self.released_at:
                    assert self.last >= self.released_at[device] + self.window
                self.copy_block(host, device, self.host_shadow, self.shadow)
            assert a.block_table(seq) == tuple(d for _, d in result.mapping)
        elif kind == "evict":
            count = rng.randint(0, 3)
            cached = len(a.cached_blocks())
            assert a.evict(count) == min(count, cached)
        elif kind == "reset":
            a.reset_cache()
            assert not a.cached_blocks()


@pytest.mark.parametrize("window", [0, 1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_content_and_accounting(window: int, seed: int) -> None:
    a = make(20, window=window, host=6)
    driver = _Driver(a, random.Random(f"kvfuzz-{window}-{seed}"))
    for _ in range(400):
        driver.op()
    # The driver exercised what it claims to (so a passing run means something).
    assert driver.stats["hits"] > 0 and driver.stats["copies"] > 0
    for seq in sorted(driver.seqs) + sorted(driver.swapped):
        a.free(seq)
    for step in range(driver.last + 1, driver.last + 1 + window + 1):
        a.step_completed(step)
    a.reset_cache()
    assert sorted(a.free_blocks()) == list(range(20)), "quiescence: every block free"
