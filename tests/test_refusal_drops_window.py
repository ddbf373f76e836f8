"""``refusal_drops_window``: a refused grow may first drop the growing sequence's blocks that no later step reads
(vLLM's ``allocate_slots`` frees out-of-window blocks before it checks for room); any other change stays a
violation."""

from __future__ import annotations

import attrs
import pytest

from kvfuzz.allocator import PoolSpec
from kvfuzz.allocator.paged import PagedAllocator
from kvfuzz.allocator.types import NULL_BLOCK, Capabilities, GrowResult, SeqId, Tokens
from kvfuzz.engine import Engine, Invariant, InvariantViolation
from kvfuzz.statemachines import MachineConfig

WINDOW = 8
CONFIG = MachineConfig(block_size=4, num_blocks=5)


class _DropsBeforeRoom(PagedAllocator):
    """kvfuzz's sliding-window allocator (W = 0), which drops, before it checks for room, every block wholly before
    ``len + 1 - w`` (the next token's window) and ``extra`` blocks more (a seeded bug when ``extra`` > 0)."""

    def __init__(self, spec: PoolSpec, declare: bool, extra: int = 0) -> None:
        super().__init__(spec.block_size, spec.num_blocks, sliding_window=WINDOW)
        self.capabilities = attrs.evolve(self.capabilities, refusal_drops_window=declare)
        self._extra = extra  # blocks dropped past the next token's window

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        state = self._running(seq, "grow")
        first_kept = max(0, len(state.tokens) + 1 - WINDOW) // self.block_size + self._extra
        for index in reversed(range(min(first_kept, len(state.table)))):
            if state.table[index] != NULL_BLOCK:
                self._pool.release(state.table[index])
                state.table[index] = NULL_BLOCK
        return super().grow(seq, tokens)


def _refused_grow(allocator: _DropsBeforeRoom) -> Engine:
    """``a`` (15 tokens: block 0 dropped at admission) and ``b`` (two blocks) fill the pool of five; growing ``a``
    by 12 tokens drops its block 1 (positions 4..7, which the next token, position 15, no longer reads), then is
    refused: it needs three blocks, and one is free."""
    engine = Engine(allocator, CONFIG)
    engine.admit("a", (), tuple(range(15)))
    engine.step()
    engine.admit("b", (), (1, 2, 3, 0) * 2)
    engine.step()
    assert engine.expected.seqs["a"].table[:2] != (NULL_BLOCK, NULL_BLOCK)
    assert not engine.grow("a", (0,) * 12)
    return engine


def test_a_declared_drop_out_of_the_next_window_is_released_and_checked() -> None:
    engine = _refused_grow(_DropsBeforeRoom(CONFIG.pool_spec(), declare=True))
    table = engine.expected.seqs["a"].table
    assert table[:2] == (NULL_BLOCK, NULL_BLOCK) and NULL_BLOCK not in table[2:]
    assert engine.stats["blocks dropped by refused grows"] == 1
    engine.step()  # attention reads positions 8..14 of a
    assert engine.grow("a", (0,))  # reaches position 15, in block 3
    engine.step()


def test_the_drop_is_a_violation_when_not_declared() -> None:
    with pytest.raises(InvariantViolation) as caught:
        _refused_grow(_DropsBeforeRoom(CONFIG.pool_spec(), declare=False))
    assert caught.value.invariant is Invariant.ATOMIC_REFUSAL


def test_a_drop_inside_the_next_window_is_caught_though_declared() -> None:
    """Block 2 holds positions 8..11, which the next token reads: dropping it loses K/V attention needs."""
    with pytest.raises(InvariantViolation) as caught:
        _refused_grow(_DropsBeforeRoom(CONFIG.pool_spec(), declare=True, extra=1))
    assert caught.value.invariant is Invariant.CONTENT
    assert "drops logical block 2, which attention still reads" in str(caught.value)


def test_the_declaration_needs_a_window() -> None:
    with pytest.raises(ValueError, match="needs a sliding window"):
        Capabilities(refusal_drops_window=True)
