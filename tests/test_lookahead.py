"""Look-ahead blocks (``lookahead_blocks``) and draft-only rollback (``speculative_tokens``): kvfuzz's allocator with a
look-ahead, the checks that hold look-ahead blocks to their rules, and that declaring a look-ahead hides no nearby bug.
"""

from __future__ import annotations

import attrs
import pytest
from factories import B, check_counts, lookahead_with_drafts, toks
from hypothesis.stateful import run_state_machine_as_test

from kvfuzz.allocator import OutOfBlocks, PagedAllocator, PoolSpec
from kvfuzz.allocator.paged import lookahead_allocator
from kvfuzz.engine import Engine, Invariant, InvariantViolation, MachineConfig
from kvfuzz.profiles import PROFILES
from kvfuzz.statemachines import machine_for
from kvfuzz.zoo import lookahead as broken

CONFIG = MachineConfig(block_size=4, num_blocks=16, num_host_blocks=8)


def make(num_blocks: int = 12, lookahead: int = 2, window: int = 0) -> PagedAllocator:
    return PagedAllocator(B, num_blocks, inflight_window=window, lookahead_blocks=lookahead)


def factory(cls: type = PagedAllocator, lookahead: int = 2, window: int = 0, **declared: object):
    """A factory for ``cls`` with ``lookahead`` blocks of look-ahead, declaring ``declared`` on top of its own."""

    def build(spec: PoolSpec) -> PagedAllocator:
        allocator = cls(
            spec.block_size, spec.num_blocks, spec.num_host_blocks, inflight_window=window, lookahead_blocks=lookahead
        )
        allocator.capabilities = attrs.evolve(allocator.capabilities, **declared)
        return allocator

    return build


def engine(build, config: MachineConfig = CONFIG) -> Engine:
    return Engine(build(config.pool_spec()), config)


def violation(call) -> InvariantViolation:
    with pytest.raises(InvariantViolation) as caught:
        call()
    return caught.value


# -- kvfuzz's allocator with a look-ahead --------------------------------------------------------------------------


def test_admit_and_grow_reserve_the_lookahead_and_grow_writes_into_it() -> None:
    a = make()
    table = a.admit("s", (), toks(0, B + 1)).block_table
    assert len(table) == 2 + 2 and len(set(table)) == 4
    result = a.grow("s", toks(100, B))  # B + 1 -> 2B + 1 tokens: into look-ahead block 2, and one more allocated
    assert a.block_table("s")[:4] == table and len(a.block_table("s")) == 3 + 2
    assert [slot.block for slot in result.slots] == [table[1]] * (B - 1) + [table[2]]
    assert result.copies == ()


def test_rollback_keeps_owned_blocks_as_lookahead_up_to_k() -> None:
    a = make()
    a.admit("s", (), toks(0, 4 * B))
    table = a.block_table("s")  # 4 blocks of tokens, 2 of look-ahead
    a.rollback("s", 3 * B)
    assert a.block_table("s") == table[: 1 + 2]
    assert all(a.refcount(block) == 0 and block in a.free_blocks() for block in table[3:])
    a.free("s")
    assert sorted(a.free_blocks()) == list(range(12))


def test_rollback_lets_cached_and_shared_blocks_go_instead_of_keeping_them() -> None:
    a = make()
    prompt = toks(0, 3 * B)
    table = a.admit("s", (), prompt).block_table
    a.step_completed(0)  # the prompt's three full blocks are matchable now
    a.rollback("s", 2 * B)
    assert a.block_table("s") == table[:1]
    assert table[1] in a.cached_blocks() and table[2] in a.cached_blocks()
    hit = a.admit("t", (), prompt)
    # Both released blocks stayed matchable; the hit stops one block short of the whole prompt (a query token).
    assert hit.num_cached_tokens == 2 * B and hit.block_table[:2] == table[:2]
    assert a.admit("u", (), prompt + toks(100, 1)).num_cached_tokens == 3 * B


def test_fork_shares_only_the_blocks_holding_tokens() -> None:
    a = make()
    table = a.admit("s", (), toks(0, B + 2)).block_table
    a.step_completed(0)
    a.fork("s", "c")
    assert a.block_table("c") == table[:2]
    assert a.refcount(table[1]) == 2 and a.refcount(table[2]) == 1


def test_a_refusal_for_want_of_lookahead_changes_nothing() -> None:
    a = make(num_blocks=3, lookahead=2)
    with pytest.raises(OutOfBlocks):
        a.admit("s", (), toks(0, B + 1))  # needs 2 + 2 blocks
    check_counts(a, {})
    assert sorted(a.free_blocks()) == [0, 1, 2]


@pytest.mark.parametrize("window", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_the_lookahead_allocator_passes_the_machine(window: int) -> None:
    run_state_machine_as_test(machine_for(factory(window=window), MachineConfig()), settings=PROFILES["ci"])


def test_draft_only_rollback_passes_the_machine() -> None:
    run_state_machine_as_test(machine_for(lookahead_with_drafts, MachineConfig()), settings=PROFILES["ci"])


def test_the_default_lookahead_factory_declares_its_lookahead() -> None:
    assert lookahead_allocator(PoolSpec(4, 8)).capabilities.lookahead_blocks == 2


# -- the engine's checks on look-ahead blocks ----------------------------------------------------------------------


def test_a_correct_lookahead_life_cycle_passes_every_check() -> None:
    h = engine(factory(window=1))
    assert h.admit("s0", (), toks(0, B + 1))
    h.step()
    assert h.grow("s0", toks(50, B))
    h.step()
    h.rollback("s0", B - 1)
    assert h.fork("s0", "s1")
    assert h.admit("s2", (), toks(0, B + 1))
    h.step()
    h.preempt("s2")
    assert h.readmit("s2")
    assert h.swap_out("s1") and h.swap_in("s1")
    h.step()
    h.quiesce()


def test_draft_only_rollback_drops_only_the_drafts_of_the_latest_grow() -> None:
    h = engine(factory(lookahead=1, speculative_tokens=3))
    state = h.expected
    assert h.admit("s", (), toks(0, 5))
    assert state.rollback_limit("s") == 0 and state.rollbackable_ids() == []  # a prompt holds no drafts
    assert h.grow("s", toks(10, 6))  # the sampled token, two verified, then three drafts
    assert state.rollback_limit("s") == 3
    h.rollback("s", 2)
    assert state.rollback_limit("s") == 1
    assert h.grow("s", (20,))  # a plain decode: the remaining draft was accepted
    assert state.rollback_limit("s") == 0


def test_more_lookahead_blocks_than_declared_are_caught() -> None:
    """Declaring a look-ahead of K does not let K + 1 extra blocks pass."""
    h = engine(factory(lookahead=2, lookahead_blocks=1))
    error = violation(lambda: h.admit("s", (), toks(0, 5)))
    assert error.invariant is Invariant.REFCOUNTS
    assert "at most 1 look-ahead block(s)" in error.explain()


def test_an_allocator_declaring_no_lookahead_is_held_to_exact_tables() -> None:
    """Without a declared look-ahead, one block beyond the tokens is a violation, at admission and after rollback."""
    h = engine(factory(lookahead=1, lookahead_blocks=0))
    error = violation(lambda: h.admit("s", (), toks(0, 5)))
    assert error.invariant is Invariant.REFCOUNTS and "exactly 2 block(s)" in error.explain()

    class KeepsBlocksOnRollback(PagedAllocator):
        def rollback(self, seq, num_tokens):
            state = self._running(seq, "rollback")
            del state.tokens[len(state.tokens) - num_tokens :], state.hashes[(len(state.tokens)) // self.block_size :]

    h = engine(factory(KeepsBlocksOnRollback, lookahead=0))
    assert h.admit("s", (), toks(0, 2 * B))
    error = violation(lambda: h.rollback("s", B))
    assert error.invariant is Invariant.REFCOUNTS


def test_a_lookahead_block_another_sequence_references_is_caught() -> None:
    """Declaring a look-ahead does not let a block beyond the tokens be shared: a fork sibling holding it is caught
    at the fork (5), and a cache hit on it at the admission (9)."""
    h = engine(factory(broken.LookaheadSharedByFork, lookahead=1))
    assert h.admit("s0", (), toks(0, B + 1))
    h.step()
    error = violation(lambda: h.fork("s0", "s1"))
    assert error.invariant is Invariant.EXCLUSIVE_WRITES
    assert "look-ahead block" in error.explain() and "shared by fork with s1" in error.explain()

    h = engine(factory(broken.LookaheadKeepsCachedBlock, lookahead=2))
    prompt = toks(0, 3 * B)
    assert h.admit("s0", (), prompt)
    h.step()
    h.rollback("s0", 2 * B)  # the two full blocks it dropped stay in its table, still matchable
    error = violation(lambda: h.admit("s1", (), prompt))
    assert error.invariant is Invariant.CACHE_SOUNDNESS
    assert "matched look-ahead block" in error.explain() and "kept as look-ahead by s0" in error.explain()


def test_a_lookahead_block_released_into_the_cache_is_caught() -> None:
    h = engine(factory(broken.LookaheadKeepsCachedBlock, lookahead=2))
    assert h.admit("s0", (), toks(0, 3 * B))
    h.step()
    h.rollback("s0", 2 * B)
    error = violation(lambda: h.free("s0"))
    assert error.invariant is Invariant.CACHE_SOUNDNESS
    assert "released as a look-ahead block, is listed as cached" in error.explain()


def test_a_lookahead_block_not_returned_on_free_is_caught() -> None:
    h = engine(factory(broken.LookaheadLeakOnFree, lookahead=1))
    assert h.admit("s0", (), toks(0, 3))
    error = violation(lambda: h.free("s0"))
    assert error.invariant is Invariant.REFCOUNTS


def test_a_rollback_moving_kept_tokens_is_caught_though_the_length_fits_the_lookahead() -> None:
    h = engine(factory(broken.RollbackDropsAcceptedBlock, lookahead=2))
    assert h.admit("s0", (), toks(0, 2 * B))
    h.step()
    error = violation(lambda: h.rollback("s0", B - 1))
    assert error.invariant is Invariant.CONTENT
    assert "changed the blocks of positions it kept" in error.explain()


def test_a_refusal_is_false_only_beyond_the_lookahead() -> None:
    """A look-ahead allocator may refuse when the pool cannot hold the look-ahead, but not when it can."""

    class RefusesOnceShort(PagedAllocator):
        def grow(self, seq, tokens):
            if self._pool.num_available() < 3:
                raise OutOfBlocks("grow: fewer than three blocks left")
            return super().grow(seq, tokens)

    config = MachineConfig(block_size=4, num_blocks=6)
    h = engine(factory(RefusesOnceShort, lookahead=2), config)
    assert h.admit("s0", (), toks(0, B))  # 1 + 2 blocks, 3 left
    assert h.grow("s0", (1,))  # one more block of tokens: 2 + 2, 2 left
    assert not h.grow("s0", toks(2, 3 * B))  # 3B + 1 more tokens: 5 + 2 blocks, three more than it holds: refused
    h = engine(factory(RefusesOnceShort, lookahead=1), config)
    assert h.admit("s0", (), toks(0, B))  # 1 + 1 blocks, 4 left
    assert h.admit("s1", (), toks(9, B))  # 1 + 1 blocks, 2 left
    error = violation(lambda: h.grow("s0", (1,)))  # needs one block, two are free
    assert error.invariant is Invariant.NO_FALSE_REFUSAL
