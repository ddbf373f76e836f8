"""Explanations name the root cause: two prefixes given one block (a colliding cache key) with both expected
contents, a hit on a slot a scheduled write has yet to fill, and block histories that name cache hits, rollbacks and
evictions. Each case is constructed, and the text a person reads is asserted."""

from __future__ import annotations

import pytest
from factories import declaring

from kvfuzz.allocator import PagedAllocator, PoolSpec
from kvfuzz.engine import Engine
from kvfuzz.engine.checks.explain import why_alike
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.zoo import variant
from kvfuzz.zoo.cache_keys import CollidingBlockKey, token_sum
from kvfuzz.zoo.variants import MatchableAtAllocation

CONFIG = MachineConfig(block_size=4, num_blocks=8, num_host_blocks=0)
FIRST = (2, 0, 1, 3)  # a block whose key (the sum of its tokens) equals SECOND's
SECOND = (1, 1, 1, 3)


def _engine(allocator: PagedAllocator, config: MachineConfig = CONFIG) -> Engine:
    return Engine(allocator, config)


def _committed(engine: Engine, seq: str, tokens: tuple[int, ...]) -> None:
    """``seq`` admitted and its full blocks matchable (W = 1: registered once the step after its write completes)."""
    engine.admit(seq, (), tokens)
    for _ in range(3):
        engine.step()


def _violation(call) -> InvariantViolation:
    with pytest.raises(InvariantViolation) as caught:
        call()
    return caught.value


def test_the_colliding_blocks_really_collide():
    assert FIRST != SECOND and token_sum(FIRST) == token_sum(SECOND)


def test_two_holders_of_a_colliding_block_are_named_with_both_expected_contents():
    engine = _engine(variant("CollidingBlockKey").factory()(PoolSpec(4, 8)))
    _committed(engine, "a", FIRST + (1,))
    violation = _violation(lambda: engine.admit("b", (), SECOND + (2,)))
    text = violation.explain()
    assert violation.invariant is Invariant.CACHE_SOUNDNESS
    assert "root cause: two holders of block 0 expect different K/V in it (b and a)" in text
    assert "b expects namespace (), tokens [1, 1, 1, 3]" in text
    assert "a expects namespace (), tokens [2, 0, 1, 3]" in text
    assert "the prefixes differ in their tokens: the allocator keyed them alike, a hash collision" in text
    assert "matched by b's cache hit as its logical block 0" in text


def test_a_collision_with_a_finished_writer_names_what_it_wrote():
    engine = _engine(variant("CollidingBlockKey").factory()(PoolSpec(4, 8)))
    _committed(engine, "a", FIRST + (1,))
    engine.free("a")
    text = _violation(lambda: engine.admit("b", (), SECOND + (2,))).explain()
    assert "root cause: block 0 holds K/V written for another prefix than the one b expects there" in text
    assert "b expects namespace (), tokens [1]" in text and "a wrote namespace (), tokens [2]" in text
    assert "a hash collision" in text


def test_prefixes_that_differ_only_in_namespace_blame_the_key_s_namespace():
    engine = _engine(variant("KeyConcatenatesNamespace").factory()(PoolSpec(4, 8)))
    engine.admit("a", ("ab", "c"), (1, 2, 3, 0, 1))
    for _ in range(3):
        engine.step()
    text = _violation(lambda: engine.admit("b", ("a", "bc"), (1, 2, 3, 0, 2))).explain()
    assert "b expects namespace ('a', 'bc'), tokens [1, 2, 3, 0]" in text
    assert "a expects namespace ('ab', 'c'), tokens [1, 2, 3, 0]" in text
    assert "differ only in their namespace: the cache key leaves the namespace out, or joins its parts" in text


def test_a_hit_on_content_only_scheduled_says_who_writes_it_and_what_is_undeclared():
    engine = _engine(variant("MatchableAtAllocation").factory()(PoolSpec(4, 8)))
    engine.admit("a", (), (1, 2, 3, 4, 5))
    violation = _violation(lambda: engine.admit("b", (), (1, 2, 3, 4, 6)))
    assert "nothing is written there yet: a writes it at the next step (step 0)" in violation.summary
    assert "nothing has been written there" not in violation.summary
    assert "only an allocator that declares hits_scheduled_writes may count K/V" in violation.explain()


class _CollidesWhenScheduled(MatchableAtAllocation, CollidingBlockKey):
    """A block matchable as soon as it is allocated, under a colliding key."""


def test_a_hit_on_a_slot_another_prefix_will_fill_says_so():
    engine = _engine(declaring(_CollidesWhenScheduled, hits_scheduled_writes=True)(PoolSpec(4, 8)))
    engine.admit("a", (), FIRST + (1,))
    violation = _violation(lambda: engine.admit("b", (), SECOND + (2,)))
    text = violation.explain()
    assert "another prefix's scheduled write will fill it: a position 0 writes there at the next step" in text
    assert "b expects namespace (), tokens [1, 1, 1, 3]" in text
    assert "a writes namespace (), tokens [2, 0, 1, 3]" in text
    assert "nothing has been written there" not in text


def test_a_block_history_names_the_rollback_that_released_it():
    config = MachineConfig(block_size=4, num_blocks=3, num_host_blocks=0)
    engine = _engine(variant("ImmediateReuse").factory()(PoolSpec(4, 3)), config)
    engine.admit("a", (), (1, 2, 3, 4, 5, 6))
    engine.step()
    engine.rollback("a", 3)
    engine.admit("b0", (), (3, 3, 3, 3))
    violation = _violation(lambda: engine.admit("b1", (), (3, 3, 3, 3)))
    assert violation.invariant is Invariant.NON_REUSE_WINDOW
    assert "step 1: released by a's rollback of 3 token(s), to length 3" in violation.explain()


def test_a_block_history_names_cache_hits_and_evictions():
    config = MachineConfig(block_size=4, num_blocks=4, num_host_blocks=0)
    engine = _engine(PagedAllocator(4, 4, inflight_window=1), config)
    _committed(engine, "a", (1, 2, 3, 0))
    engine.free("a")
    assert engine.admit("b", (), (1, 2, 3, 0, 1))
    cached = engine.expected.seqs["b"].table[0]
    assert "matched by b's cache hit as its logical block 0" in "\n".join(engine.pools.block_story(cached))
    engine.free("b")
    engine.step()
    engine.step()
    assert engine.admit("c", (), (0,) * 16)  # the whole pool: the cached block is evicted for c
    story = "\n".join(engine.pools.block_story(cached))
    assert "evicted from the cache, to be reused" in story and "admitted as c as logical block" in story
    engine.quiesce()


def test_an_explicit_eviction_is_in_the_block_s_history():
    engine = _engine(PagedAllocator(4, 8, inflight_window=1))
    _committed(engine, "a", (1, 2, 3, 0))
    block = engine.expected.seqs["a"].table[0]
    engine.free("a")
    engine.step()
    engine.step()
    engine.evict(1)
    assert "evicted from the cache (evict(1))" in "\n".join(engine.pools.block_story(block))


# -- the true cause, where one symptom has several ----------------------------------------------------------------


class _AdmitTakesPendingBlocks(PagedAllocator):
    """An admission that counts blocks still in their in-flight window as free: before allocating, it returns every
    pending block to the free set and drops its cache entry (a free-block counter that includes blocks "about to be
    freed")."""

    def admit(self, seq, namespace, tokens):
        pool = self._pool
        for block in list(pool._pending):
            del pool._pending[block]
            self._cache.unregister(block)
            pool._free[block] = None
        pool._pending_order.clear()
        return super().admit(seq, namespace, tokens)


class _FreeLeaks(PagedAllocator):
    """A free that drops each block's reference but never returns a block to the pool (the cleanup the finish path
    runs, skipped)."""

    def free(self, seq):
        state = self._seqs.pop(seq)
        state.live = False
        for block in state.table:
            self._pool._refcount[block] -= 1


class _RollbackQueuesKeptBlock(PagedAllocator):
    """A rollback whose deferred-free queue is off by one: besides the dropped tail, it queues the last block it
    keeps, which the sequence still maps."""

    def rollback(self, seq, num_tokens):
        super().rollback(seq, num_tokens)
        pool = self._pool
        kept = self._seqs[seq].table[-1]
        until = pool.last_completed_step + pool.inflight_window
        pool._pending[kept] = until
        pool._pending_order.append((until, kept))


def _one_window(cls: type, num_blocks: int) -> tuple[Engine, MachineConfig]:
    config = MachineConfig(block_size=4, num_blocks=num_blocks, num_host_blocks=0)
    return _engine(cls(4, num_blocks, inflight_window=1), config), config


def test_a_missed_hit_on_a_block_handed_out_again_inside_its_window_says_so():
    engine, _ = _one_window(_AdmitTakesPendingBlocks, 2)
    _committed(engine, "a", (1, 2, 3, 0, 1))
    engine.free("a")
    violation = _violation(lambda: engine.admit("b", (), (1, 2, 3, 0, 2)))
    text = violation.explain()
    assert violation.invariant is Invariant.COMPLETE_CACHING
    assert "block 0 was handed out again inside its in-flight window: b maps it as its logical block 1" in text
    assert "released by a while step 3 was being scheduled; with W = 1, its in-flight window lasts until step 2" in text


def test_a_missed_hit_on_a_block_freed_inside_its_window_says_so():
    engine, _ = _one_window(_AdmitTakesPendingBlocks, 8)
    _committed(engine, "a", (1, 2, 3, 0, 1))
    engine.free("a")
    violation = _violation(lambda: engine.admit("b", (), (1, 2, 3, 0, 2)))
    assert violation.invariant is Invariant.COMPLETE_CACHING
    assert "block 0 is in the free set inside its in-flight window (it was released by a" in violation.explain()


def test_a_missed_hit_on_a_block_the_allocator_keeps_says_the_lookup_missed_it():
    engine = _engine(variant("CachesPromptBlocksOnly").factory()(PoolSpec(4, 8)))
    engine.admit("a", (), (1, 2, 3))
    engine.step()
    engine.grow("a", (0, 1))
    for _ in range(3):
        engine.step()
    violation = _violation(lambda: engine.admit("b", (), (1, 2, 3, 0, 2)))
    assert violation.invariant is Invariant.COMPLETE_CACHING
    assert "block 0 is still mapped by [('a', 0)], yet the cache did not match it" in violation.explain()


def test_a_leaked_owed_block_is_not_said_to_have_gone_to_the_free_set():
    engine, _ = _one_window(_FreeLeaks, 8)
    _committed(engine, "a", (1, 2, 3, 0, 1))
    violation = _violation(lambda: engine.free("a"))
    assert violation.invariant is Invariant.COMPLETE_CACHING
    assert "went to the free set" not in violation.summary
    assert "went to none of the free, cached and pending sets (leaked)" in violation.summary


def test_a_pending_block_a_live_sequence_maps_is_not_said_to_be_past_its_window():
    engine, _ = _one_window(_RollbackQueuesKeptBlock, 8)
    engine.admit("a", (), (1, 2, 3, 0, 1, 2, 3, 0, 1))
    engine.step()
    violation = _violation(lambda: engine.rollback("a", 5))
    text = violation.explain()
    assert violation.invariant is Invariant.FREE_SET
    assert "though its window has closed" not in text
    assert "block 0 is pending though [('a', 0)] still maps it" in text


def test_prefixes_that_part_inside_the_block_suspect_a_write_in_place_first():
    cached, rewritten = ((), (1, 2, 3, 0, 1, 1, 2, 3)), ((), (1, 2, 3, 0, 1, 1, 2, 1))
    assert (
        "agree up to position 6, inside the block, and differ from position 7 on: the block was written in place"
        in (why_alike(cached, rewritten, block_start=4))
    )
    parted_at_the_block = ((), (1, 2, 3, 0, 2, 1, 2, 3))
    assert "a hash collision" in why_alike(cached, parted_at_the_block, block_start=4)


def test_a_release_path_says_what_the_operation_does_not_that_it_did_it_right() -> None:
    """Before: a rollback that leaked its dropped blocks was explained as "a rollback that released the blocks it
    dropped", exactly what it failed to do (issue 45, item 9)."""
    from kvfuzz.engine.checks.accounting import release_path

    path = release_path("rollback('s0', 2)")
    assert path == "a rollback, which drops blocks from the table (their references, released or not)"
    assert "released the" not in path
