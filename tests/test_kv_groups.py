"""Several KV-cache groups per sequence (vLLM's hybrid models): the contract's declaration and its validation."""

from __future__ import annotations

import attrs
import pytest
import torch

from kvfuzz.allocator import Capabilities, KVGroup
from kvfuzz.allocator.hybrid import HybridAllocator, hybrid_allocator, hybrid_allocator_sliding_double
from kvfuzz.allocator.protocol import declares
from kvfuzz.allocator.types import NULL_BLOCK, group_block_sizes
from kvfuzz.engine import Engine, Invariant, InvariantViolation, MachineConfig
from kvfuzz.engine.engine import GeometryMismatch
from kvfuzz.runner import run
from kvfuzz.zoo.hybrid import (
    BlockInBothGroups,
    HitGroupsSwapped,
    HitInPoolBlocks,
    HybridHitFromFullGroup,
    WindowInPoolBlocks,
)

HYBRID = (KVGroup("full"), KVGroup("sliding", sliding_window=8))


def test_groups_bring_the_group_tables_method():
    assert declares(Capabilities(kv_groups=HYBRID), "group_block_tables")
    assert not declares(Capabilities(), "group_block_tables")


@pytest.mark.parametrize(
    ("changes", "complaint"),
    [
        ({"kv_groups": HYBRID[:1]}, "two or more groups"),
        ({"kv_groups": (KVGroup("a"), KVGroup("a"))}, "names must differ"),
        ({"kv_groups": HYBRID, "sliding_window": 8}, "sliding_window must be None"),
        ({"kv_groups": HYBRID, "swap": True}, "swap"),
        ({"kv_groups": HYBRID, "host_cache": True}, "host_cache"),
        ({"kv_groups": ("full", "sliding")}, "KVGroup values"),
    ],
)
def test_a_grouped_declaration_kvfuzz_cannot_check_is_refused(changes, complaint):
    with pytest.raises(ValueError, match=complaint):
        Capabilities(**changes)


def test_a_group_needs_a_name_and_a_positive_window():
    with pytest.raises(ValueError):
        KVGroup("")
    with pytest.raises(ValueError):
        KVGroup("sliding", sliding_window=0)


# -- the engine around a grouped allocator ------------------------------------------------------------------------

CONFIG = MachineConfig(block_size=4, num_blocks=16)
PROMPT = (5, 6, 7, 8, 9, 10, 11, 12)


def _engine(cls: type[HybridAllocator] = HybridAllocator) -> Engine:
    return Engine(cls(CONFIG.block_size, CONFIG.num_blocks, inflight_window=0, sliding_window=9), CONFIG)


def test_kvfuzz_hybrid_allocator_runs_clean() -> None:
    summary = run(hybrid_allocator, MachineConfig(), examples=150, steps=40, shrink=False)
    assert not summary.failed, summary.explanation
    assert summary.operations["cache hits"] > 0, summary.operations


def test_each_group_holds_its_own_kv_for_the_same_position() -> None:
    """The engine writes every token into each group's slot with that group's K/V: the two slots of one position
    differ in content, so a block read through the wrong group's table is a content failure."""
    engine = _engine()
    engine.admit("s0", ("ns",), PROMPT)
    engine.step()
    full = engine.expected.seqs["s0"].table
    sliding = engine.expected.seqs["s0@sliding"].table
    assert len(full) == len(sliding) == 2 and not set(full) & set(sliding)
    size = CONFIG.block_size
    full_record = engine.pools.record(full[1] * size + 3)
    sliding_record = engine.pools.record(sliding[1] * size + 3)
    assert full_record is not None and sliding_record is not None
    assert full_record.position == sliding_record.position == 7
    assert full_record.tag != sliding_record.tag
    keys, _ = engine.pools.rows([full[1] * size + 3, sliding[1] * size + 3])
    assert not torch.equal(keys[0], keys[1])
    assert "group sliding" in sliding_record.describe()


def _evict_the_sliding_window_then_hit(engine: Engine) -> None:
    """s0's first block stays cached in the full group while its sliding-window copy is dropped and evicted; then
    s1 asks for s0's prompt again."""
    engine.admit("s0", ("ns",), PROMPT[:4])
    engine.step()
    engine.grow("s0", PROMPT[4:] + (13, 14, 15, 16, 17))  # 13 tokens: the sliding group drops block 0
    engine.step()
    engine.step()
    dropped = [block for block in engine.expected.released_blocks() if block not in engine.expected.refs.holders]
    assert dropped, "the sliding group released its first block"
    engine.evict_blocks(tuple(dropped))
    engine.admit("s1", ("ns",), PROMPT)


def test_a_hit_must_hold_in_the_sliding_window_group_too() -> None:
    engine = _engine()
    _evict_the_sliding_window_then_hit(engine)  # the correct allocator reports no hit
    assert engine.expected.seqs["s1"].written == 0


def test_a_hit_from_the_full_group_alone_is_unsound() -> None:
    engine = _engine(HybridHitFromFullGroup)
    with pytest.raises(InvariantViolation) as caught:
        _evict_the_sliding_window_then_hit(engine)
    assert caught.value.invariant is Invariant.CACHE_SOUNDNESS
    assert "sequence s1, group sliding" in caught.value.summary


def test_one_block_in_two_groups_is_named_with_both_entries() -> None:
    engine = _engine(BlockInBothGroups)
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("s0", ("ns",), PROMPT[:6])
    assert caught.value.invariant is Invariant.REFCOUNTS
    assert "2 KV-cache groups" in caught.value.summary
    assert "sequence s0, group full logical block 1; sequence s0, group sliding logical block 1" in str(caught.value)


def test_a_hit_may_leave_out_the_sliding_blocks_the_next_token_does_not_read() -> None:
    """Window 9, blocks of 4: a hit of 12 tokens needs the sliding group's positions 4..11 (what position 12 reads
    besides itself), so its block 0, dropped and evicted, may stay NULL_BLOCK while the full group hits all three."""
    engine = _engine()
    tokens = tuple(range(20, 34))
    engine.admit("s0", ("ns",), tokens[:12])
    engine.step()
    engine.grow("s0", tokens[12:14])  # 14 tokens: the sliding group drops block 0 (positions 0..3 < 14 - 9)
    engine.step()
    engine.step()
    dropped = [block for block in engine.expected.released_blocks() if block not in engine.expected.refs.holders]
    engine.evict_blocks(tuple(dropped))
    engine.admit("s1", ("ns",), tokens[:13])
    assert engine.expected.seqs["s1"].written == 12
    assert engine.expected.seqs["s1@sliding"].table[0] == NULL_BLOCK
    engine.step()
    engine.quiesce()


def test_a_block_read_through_the_wrong_group_is_another_layers_kv() -> None:
    """Each group's cached block of one prefix given to the other group: every block is in one group's tables, so
    only the K/V tell the mix-up, and the report names both groups."""
    engine = _engine(HitGroupsSwapped)
    engine.admit("s0", ("ns",), PROMPT[:5])
    engine.step()
    engine.free("s0")
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("s1", ("ns",), PROMPT[:6])
    assert caught.value.invariant is Invariant.CACHE_SOUNDNESS
    assert "cache hit of 4 tokens for sequence s1, group full" in caught.value.summary
    assert "in group sliding" in str(caught.value) and "differ only in their KV-cache group" in str(caught.value)


# -- groups of different block sizes ------------------------------------------------------------------------------


def _double_engine(cls: type[HybridAllocator] = HybridAllocator, window: int = 17) -> Engine:
    """Blocks of 4 tokens in the full group and 8 in the sliding group (window 17), over one pool of 16 blocks (the
    zoo's slips below set the sliding group's 8 themselves)."""
    options = {"sliding_block_size": 8} if cls is HybridAllocator else {}
    return Engine(
        cls(CONFIG.block_size, CONFIG.num_blocks, inflight_window=0, sliding_window=window, **options), CONFIG
    )


def test_a_group_block_size_must_be_a_positive_multiple_of_the_pool_block_size() -> None:
    with pytest.raises(ValueError):
        KVGroup("sliding", block_size=0)
    assert group_block_sizes((KVGroup("full"), KVGroup("sliding", block_size=12)), 4) == (4, 12)
    with pytest.raises(ValueError, match="multiple of the pool's block size 4, got sliding: 6"):
        group_block_sizes((KVGroup("full"), KVGroup("sliding", block_size=6)), 4)
    with pytest.raises(ValueError, match="got sliding: 6"):
        HybridAllocator(CONFIG.block_size, CONFIG.num_blocks, sliding_block_size=6)
    odd = HybridAllocator(CONFIG.block_size, CONFIG.num_blocks)
    odd.capabilities = attrs.evolve(odd.capabilities, kv_groups=(KVGroup("full"), KVGroup("sliding", block_size=6)))
    with pytest.raises(GeometryMismatch, match="multiple of the pool's block size 4, got sliding: 6"):
        Engine(odd, CONFIG)


def test_each_group_lays_its_positions_out_at_its_own_block_size() -> None:
    """Pool rows per block are the largest group's (8); the full group uses the first 4 rows of each of its blocks.
    Position 9 of a 10-token prompt: full group block 2 offset 1, sliding group block 1 offset 1."""
    engine = _double_engine()
    engine.admit("s0", ("ns",), tuple(range(40, 50)))
    engine.step()
    full = engine.expected.seqs["s0"].table
    sliding = engine.expected.seqs["s0@sliding"].table
    assert len(full) == 3 and len(sliding) == 2  # ceil(10 / 4), ceil(10 / 8)
    assert engine.expected.rows == 8 and engine.pools.keys.shape[0] == CONFIG.num_blocks * 8
    full_record = engine.pools.record(full[2] * 8 + 1)
    sliding_record = engine.pools.record(sliding[1] * 8 + 1)
    assert full_record is not None and full_record.position == 9
    assert sliding_record is not None and sliding_record.position == 9
    assert engine.pools.record(full[2] * 8 + 4) is None  # rows 4..7 of a full-group block are never used
    engine.grow("s0", (50,))
    engine.step()
    engine.quiesce()


def test_a_hit_is_a_multiple_of_every_group_block_size() -> None:
    """A 13-token prompt after a 12-token one: 12 tokens are cached in the full group (3 blocks of 4), but the
    sliding group's second block (positions 8..15) is not full, so the hit is 8 (the lcm of 4 and 8)."""
    engine = _double_engine()
    tokens = tuple(range(60, 80))
    engine.admit("s0", ("ns",), tokens[:16])
    engine.step()
    engine.free("s0")
    engine.admit("s1", ("ns",), tokens[:13])
    assert engine.expected.seqs["s1"].written == 8
    engine.admit("s2", ("ns",), tokens[:17])
    assert engine.expected.seqs["s2"].written == 16
    engine.step()
    engine.quiesce()


def test_kvfuzz_hybrid_allocator_with_a_double_sliding_block_runs_clean() -> None:
    summary = run(hybrid_allocator_sliding_double, MachineConfig(), examples=150, steps=40, shrink=False)
    assert not summary.failed, summary.explanation
    assert summary.operations["cache hits"] > 0, summary.operations


class _SlidingTableAtPoolBlockSize(HybridAllocator):
    """Declares the sliding group at 8 tokens per block but sizes its table in blocks of the pool's 4."""

    def _blocks_for(self, group: int, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def test_a_group_table_sized_at_the_pool_block_size_is_caught() -> None:
    engine = Engine(
        _SlidingTableAtPoolBlockSize(CONFIG.block_size, CONFIG.num_blocks, inflight_window=0, sliding_block_size=8),
        CONFIG,
    )
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("s0", ("ns",), tuple(range(40, 50)))
    assert caught.value.invariant is Invariant.REFCOUNTS
    assert "holds 3 block(s) for 10 tokens" in caught.value.summary
    assert "exactly 2 block(s) of 8 slots" in str(caught.value)


def test_a_window_found_at_the_pool_block_size_drops_a_block_still_read() -> None:
    """Window 17, 20 tokens: the window starts at position 3, so the sliding group keeps both 8-token blocks;
    counted in 4-token blocks, (20 - 17) // 4 = 0 too, but at 24 tokens 7 // 4 = 1 drops block 0 (positions 0..7),
    which position 7 of the window (24 - 17 = 7) still needs."""
    engine = _double_engine(WindowInPoolBlocks)
    engine.admit("s0", ("ns",), tuple(range(40, 60)))
    engine.step()
    with pytest.raises(InvariantViolation) as caught:
        engine.grow("s0", tuple(range(60, 64)))
    assert caught.value.invariant is Invariant.CONTENT
    assert "drops logical block 0, which attention still reads" in caught.value.summary


def test_a_hit_ending_inside_a_larger_group_block_is_unsound() -> None:
    engine = _double_engine(HitInPoolBlocks)
    tokens = tuple(range(60, 80))
    engine.admit("s0", ("ns",), tokens[:16])
    engine.step()
    engine.free("s0")
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("s1", ("ns",), tokens[:13])
    assert caught.value.invariant is Invariant.CACHE_SOUNDNESS
    assert "cache hit of 12 tokens for sequence s1 ends inside a block of group sliding" in caught.value.summary
    assert "a multiple of 8 tokens" in str(caught.value)
