"""Eviction as the contract declares it: evict(n) rounded up to whole subtrees (``evict_rounds_up``), targeted
eviction by block id (``targeted_eviction``), and the eviction-order policy (``eviction_order``): each checked
exactly, and none of the declarations hiding a real bug next to what it allows."""

from __future__ import annotations

import random
from typing import Sequence

import pytest
from factories import declaring, make_allocator

from kvfuzz.allocator import EvictionOrder, PagedAllocator
from kvfuzz.engine import Engine, Invariant, InvariantViolation, MachineConfig
from kvfuzz.engine.arguments import BlockIds
from kvfuzz.program.operations import BY_NAME
from kvfuzz.zoo.eviction import SubtreeEvictor

CONFIG = MachineConfig(block_size=4, num_blocks=8)
CHAIN = (1, 2, 3, 0, 2, 2, 1, 3, 0, 1, 2, 3, 3)  # three full blocks and one token
OTHER = (3, 3, 3, 3, 0, 0, 0, 0, 1)  # two full blocks and one token, sharing nothing with CHAIN


def engine(factory) -> Engine:
    return Engine(factory(CONFIG.pool_spec()), CONFIG)


def cache(h: Engine, *prompts: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Admit, compute and free each prompt; return their tables (with W = 0, their full blocks stay cached)."""
    seqs = [f"p{i}" for i in range(len(prompts))]
    for seq, prompt in zip(seqs, prompts):
        assert h.admit(seq, (), prompt)
    h.step()
    h.step()
    tables = [h.expected.seqs[seq].table for seq in seqs]
    for seq in seqs:
        h.free(seq)
    return tables


# -- evict(n) rounding up to whole subtrees ----------------------------------------------------------------------


def test_a_rounding_eviction_may_drop_more_than_asked_and_is_checked_exactly() -> None:
    h = engine(declaring(SubtreeEvictor))
    assert h.caps.evict_rounds_up
    cache(h, CHAIN, OTHER)
    assert len(h.allocator.cached_blocks()) == 5
    h.evict(1)  # the least recently released block's subtree: CHAIN's last full block alone, or more
    assert h.stats["evicted blocks"] >= 1
    h.evict(4)
    assert not h.allocator.cached_blocks()


class _RoundsUpOverReporting(SubtreeEvictor):
    """Drops whole subtrees, but reports one block more than it dropped."""

    def evict(self, num_blocks: int) -> int:
        return super().evict(num_blocks) + 1


class _RoundsUpIntoReferencedBlocks(SubtreeEvictor):
    """Drops whole subtrees, and also frees a block a running sequence still references."""

    def evict(self, num_blocks: int) -> int:
        dropped = super().evict(num_blocks)
        referenced = next(block for block in range(self.num_blocks) if self._pool.refcount(block))
        self._pool._refcount[referenced] = 0
        self._pool._free[referenced] = None
        return dropped


@pytest.mark.parametrize("broken", [_RoundsUpOverReporting, _RoundsUpIntoReferencedBlocks])
def test_rounding_up_does_not_excuse_a_wrong_count_or_a_referenced_block(broken) -> None:
    h = engine(declaring(broken))
    cache(h, CHAIN, OTHER)
    assert h.admit("running", (), (0, 0, 0, 0, 1))
    with pytest.raises(InvariantViolation) as caught:
        h.evict(1)
    assert caught.value.invariant in (Invariant.FREE_SET, Invariant.REFCOUNTS)


class _EvictsOneMore(PagedAllocator):
    """evict(n) drops n + 1 cached blocks and says so."""

    def evict(self, num_blocks: int) -> int:
        return super().evict(num_blocks + 1)


def test_dropping_more_than_asked_is_caught_unless_rounding_up_is_declared() -> None:
    h = engine(declaring(_EvictsOneMore))
    cache(h, CHAIN)
    with pytest.raises(InvariantViolation) as caught:
        h.evict(1)
    assert caught.value.invariant is Invariant.FREE_SET
    assert "between 0 and 1" in str(caught.value)
    h = engine(declaring(_EvictsOneMore, evict_rounds_up=True))
    cache(h, CHAIN)
    h.evict(1)
    assert h.stats["evicted blocks"] == 2


# -- targeted eviction ---------------------------------------------------------------------------------------------


def test_evict_blocks_cuts_a_cached_chain_and_the_next_hit_stops_before_the_cut() -> None:
    h = engine(make_allocator())
    assert h.caps.targeted_eviction
    (table,) = cache(h, CHAIN)
    h.evict_blocks((table[1], table[3]))  # the chain's middle block, and its partial block, which is not cached
    assert sorted(h.allocator.cached_blocks()) == sorted((table[0], table[2]))
    assert table[3] in h.allocator.free_blocks()
    assert h.admit("again", (), CHAIN)
    assert h.stats["cache-hit tokens"] == 4  # the first block only: the hit does not run on past the cut


class _EvictsTheWholeChain(PagedAllocator):
    """Targeted eviction that drops every cached block, not only the named ones."""

    def evict_blocks(self, blocks: Sequence[int]) -> None:
        self.reset_cache()


def test_targeted_eviction_may_not_drop_blocks_it_was_not_given() -> None:
    h = engine(declaring(_EvictsTheWholeChain))
    (table,) = cache(h, CHAIN)
    with pytest.raises(InvariantViolation) as caught:
        h.evict_blocks((table[1],))
    assert caught.value.invariant is Invariant.FREE_SET
    assert "it was not given" in str(caught.value)


class _EvictBlocksIgnored(PagedAllocator):
    """Targeted eviction that does nothing."""

    def evict_blocks(self, blocks: Sequence[int]) -> None:
        pass


def test_targeted_eviction_that_keeps_a_named_block_cached_is_caught() -> None:
    h = engine(declaring(_EvictBlocksIgnored))
    (table,) = cache(h, CHAIN)
    with pytest.raises(InvariantViolation) as caught:
        h.evict_blocks((table[1],))
    assert caught.value.invariant is Invariant.FREE_SET
    assert f"left block(s) [{table[1]}] cached" in str(caught.value)


def test_without_introspection_a_hit_past_an_evicted_block_is_still_caught() -> None:
    h = engine(declaring(_EvictBlocksIgnored, introspection=False))
    (table,) = cache(h, CHAIN)
    h.evict_blocks((table[1],))  # nothing to compare without the cached set
    with pytest.raises(InvariantViolation) as caught:
        h.admit("again", (), CHAIN)
    assert caught.value.invariant is Invariant.CACHE_SOUNDNESS
    assert f"block {table[1]}), which an eviction dropped" in str(caught.value)


def test_reset_cache_leaves_nothing_matchable_among_released_blocks() -> None:
    h = engine(declaring(PagedAllocator, introspection=False))
    cache(h, CHAIN)
    h.allocator.reset_cache = lambda: None  # a reset that forgets to drop anything
    h.reset_cache()
    with pytest.raises(InvariantViolation) as caught:
        h.admit("again", (), CHAIN)
    assert caught.value.invariant is Invariant.CACHE_SOUNDNESS


def test_block_ids_draw_replay_and_refuse_alike() -> None:
    h = engine(make_allocator())
    (table,) = cache(h, CHAIN)
    operation = BY_NAME["evict_blocks"]
    assert operation.enabled(h.expected)
    arguments = operation.draw(h.expected, random.Random(0))
    assert operation.accepts(h.expected, arguments)
    assert set(arguments["blocks"]) <= set(table)
    argument = BlockIds(lambda state: state.released_blocks())
    assert not argument.accepts(h.expected, [table[0], table[0]])  # twice
    assert not argument.accepts(h.expected, [])
    assert not argument.accepts(h.expected, [CONFIG.num_blocks - 1])  # never released
    assert h.admit("holder", (), CHAIN)
    assert not argument.accepts(h.expected, [table[0]])  # referenced again by the hit


def test_evict_blocks_is_never_driven_undeclared() -> None:
    h = engine(declaring(PagedAllocator, targeted_eviction=False))
    cache(h, CHAIN)
    assert not BY_NAME["evict_blocks"].enabled(h.expected)


# -- eviction order ----------------------------------------------------------------------------------------------


def test_kvfuzz_allocator_declares_lru_and_keeps_it_under_pressure() -> None:
    h = engine(make_allocator())
    assert h.caps.eviction_order is EvictionOrder.LRU
    cache(h, CHAIN, OTHER)
    assert len(h.allocator.cached_blocks()) == 5
    for index in range(7):  # the three free blocks, then cached ones, least recently released first
        assert h.admit(f"n{index}", (), (index % 4, 0, index // 4))
        h.step()
    assert len(h.allocator.cached_blocks()) == 1


class _PrefersCachedBlocks(PagedAllocator):
    """Hands out the least recently released cached block before any free one."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        pool = self._pool
        original = pool.allocate

        def allocate(count: int, reserve: int = 0) -> list[int]:
            if pool._evictable and count:
                block = next(iter(pool._evictable))
                del pool._evictable[block]
                pool._on_evict(block)
                pool._refcount[block] = 1
                return [block, *original(count - 1, reserve)]
            return original(count, reserve)

        pool.allocate = allocate


def test_evicting_a_cached_block_while_a_free_one_is_left_is_caught() -> None:
    h = engine(declaring(_PrefersCachedBlocks))
    (table,) = cache(h, CHAIN)
    with pytest.raises(InvariantViolation) as caught:
        h.admit("new", (), (3, 3, 3))
    assert caught.value.invariant is Invariant.EVICTION_ORDER
    assert f"reused cached block {table[2]} for new content while block" in str(caught.value)


def test_the_same_allocator_without_a_declared_order_is_not_held_to_one() -> None:
    h = engine(declaring(_PrefersCachedBlocks, eviction_order=None))
    cache(h, CHAIN)
    assert h.admit("new", (), (3, 3, 3))


# -- complete caching ----------------------------------------------------------------------------------------------


def test_kvfuzz_allocator_keeps_every_computed_full_block_matchable() -> None:
    h = engine(make_allocator(window=1))
    assert h.caps.complete_caching
    assert h.admit("s0", (), CHAIN[:6])
    h.step()
    assert h.grow("s0", CHAIN[6:9])  # fills the second block by a chunk
    h.step()
    h.step()
    h.free("s0")
    assert h.admit("again", (), CHAIN)
    assert h.stats["cache-hit tokens"] == 8


class _DropsCacheAtStepCompletion(PagedAllocator):
    """Drops every cached, unreferenced block whenever a step completes: no eviction was asked for, no room needed."""

    def step_completed(self, step: int) -> None:
        super().step_completed(step)
        self.reset_cache()


def test_a_cache_dropped_without_an_eviction_is_a_missed_hit_naming_the_block_and_its_writer() -> None:
    h = engine(declaring(_DropsCacheAtStepCompletion))
    (table,) = cache(h, CHAIN)
    h.step()  # its completion drops the cached chain
    with pytest.raises(InvariantViolation) as caught:
        h.admit("again", (), CHAIN)
    assert caught.value.invariant is Invariant.COMPLETE_CACHING
    explanation = str(caught.value)
    assert "reports 0 cached tokens, but its first 12 are matchable (a missed hit)" in explanation
    assert f"block {table[0]} holds its K/V, written by p0 as its logical block 0 at step 0" in explanation


def test_evicted_blocks_are_no_longer_owed() -> None:
    h = engine(make_allocator())
    (table,) = cache(h, CHAIN)
    h.evict_blocks((table[1],))
    h.evict(1)  # the least recently released: the chain's last full block
    assert h.admit("again", (), CHAIN)
    assert h.stats["cache-hit tokens"] == 4


def test_the_same_drop_is_not_held_against_an_allocator_that_does_not_declare_complete_caching() -> None:
    h = engine(declaring(_DropsCacheAtStepCompletion, complete_caching=False))
    cache(h, CHAIN)
    h.step()
    assert h.admit("again", (), CHAIN)


def test_with_window_two_a_rollback_before_the_block_is_owed_cancels_the_debt() -> None:
    """W = 2: the prompt's writes land in step 1, which completes at step 3's launch, but the allocator can only know
    them complete once step c + W + 1 = 2 has. A rollback into the block before then cancels what was owed, and the
    sequence may refill the block in place with other tokens: no missed hit for the old prefix."""
    h = engine(make_allocator(window=2))
    h.step()  # step 0: the pipeline fills, nothing completes
    assert h.admit("s0", (), CHAIN[:11])  # two full blocks, owed once step 2 has completed
    h.step()
    h.step()
    h.step()  # step 1 completes, step 2 not yet
    h.rollback("s0", 8)  # back into the first block: it holds CHAIN[:3]
    assert h.grow("s0", (CHAIN[3] + 1,))  # the first block is full again, with another prefix
    h.step()  # step 2 completes
    assert h.admit("s1", (), CHAIN[:5])
    assert h.stats["cache-hit tokens"] == 0


def test_with_window_two_a_full_block_is_owed_from_step_c_plus_three_and_survives_a_rollback() -> None:
    """W = 2, once step c + W + 1 has completed: a rollback into the block no longer cancels the debt (the allocator
    copies the block before writing it), and a cache dropped without an eviction is a missed hit."""
    h = engine(make_allocator(window=2))
    h.step()
    assert h.admit("s0", (), CHAIN[:11])
    for _ in range(4):
        h.step()  # step 2 completes at step 4's launch
    h.rollback("s0", 8)
    assert h.grow("s0", (CHAIN[3] + 1,))
    assert h.admit("s1", (), CHAIN[:5])
    assert h.stats["cache-hit tokens"] == 4

    dropping = engine(declaring(_DropsCacheAtStepCompletion, window=2))
    dropping.step()
    assert dropping.admit("s0", (), CHAIN[:11])
    for _ in range(4):
        dropping.step()
    dropping.free("s0")
    for _ in range(3):
        dropping.step()  # the released blocks leave the window, and a completion drops them
    with pytest.raises(InvariantViolation) as caught:
        dropping.admit("again", (), CHAIN)
    assert caught.value.invariant is Invariant.COMPLETE_CACHING
