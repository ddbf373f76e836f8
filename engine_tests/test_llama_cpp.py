"""llama.cpp's unified KV cache behind kvfuzz (kvfuzz.adapters.llama_cpp), through llama-cpp-python.

Runs in its own environment (``scripts/third_party_env.sh llama-cpp``; CI runs it there): without llama-cpp-python
and gguf the import fails loudly rather than skipping. The model is the tiny llama the adapter writes at load time.

Besides the machine, each check the adapter makes against llama.cpp is shown to fail on a deliberately wrong
wrapper: the state API's cell list (a ``seq_cp`` or ``seq_rm`` with the wrong range), the position range, the
attention mask (cells misread) and the logits against a fresh contiguous decode (K/V of the wrong tokens).
"""

from __future__ import annotations

import pytest
from hypothesis.stateful import run_state_machine_as_test

from kvfuzz.adapters.llama_cpp import LlamaCppKVCache, unified_cache, unified_cache_micro_batches
from kvfuzz.adapters.llama_cpp._library import Context, Decoded
from kvfuzz.allocator import AllocatorError, InvalidArgument, OutOfBlocks, PoolSpec, UnknownSequence
from kvfuzz.engine import Engine
from kvfuzz.engine.violations import InvariantViolation
from kvfuzz.profiles import PROFILES
from kvfuzz.statemachines import MachineConfig, machine_for

SPEC = PoolSpec(block_size=1, num_blocks=16)  # a cache of 256 cells, the first 240 held by the ballast
CONFIG = MachineConfig(block_size=1, num_blocks=16, num_host_blocks=0)
PROMPT = (1, 2, 3, 0, 2)


@pytest.mark.parametrize("factory", [unified_cache, unified_cache_micro_batches], ids=lambda factory: factory.__name__)
def test_machine_under_the_ci_profile(factory) -> None:
    run_state_machine_as_test(machine_for(factory, CONFIG), settings=PROFILES["ci"])


def test_each_token_gets_one_cell_read_back_from_the_decode() -> None:
    """The cache searches on from the ballast and takes empty cells one by one: the prompt lands in cells
    240..244 (blocks 0..4), a second sequence after it; the blocks no sequence holds are free."""
    allocator = unified_cache(SPEC)
    assert allocator.num_blocks == 16 and allocator.block_size == 1
    assert allocator.library_block_name(0) == "llama.cpp cell 240"
    assert allocator.admit("a", (), PROMPT).block_table == (0, 1, 2, 3, 4)
    assert allocator.admit("b", (), (3, 3)).block_table == (5, 6)
    grown = allocator.grow("a", (1, 0))
    assert [(slot.block, slot.offset) for slot in grown.slots] == [(7, 0), (8, 0)]
    assert allocator.block_table("a") == (0, 1, 2, 3, 4, 7, 8)
    assert sorted(allocator.free_blocks()) == list(range(9, 16))
    assert [allocator.refcount(block) for block in (0, 5, 9)] == [1, 1, 0]


def test_a_pool_of_whole_contexts_has_no_ballast() -> None:
    allocator = unified_cache(PoolSpec(block_size=1, num_blocks=256))
    assert allocator.library_block_name(0) == "llama.cpp cell 0"
    assert allocator.admit("a", (), PROMPT).block_table == (0, 1, 2, 3, 4)
    assert len(allocator.free_blocks()) == 251


def test_a_fork_shares_every_cell_and_each_branch_then_writes_its_own() -> None:
    allocator = unified_cache(SPEC)
    parent = allocator.admit("a", (), PROMPT).block_table
    assert allocator.fork("a", "b") is None
    assert allocator.block_table("b") == parent
    assert all(allocator.refcount(cell) == 2 for cell in parent)
    child_cell = allocator.grow("b", (0,)).slots[0].block
    parent_cell = allocator.grow("a", (1,)).slots[0].block
    assert child_cell not in parent and parent_cell not in parent and child_cell != parent_cell
    assert allocator.block_table("a") == parent + (parent_cell,)
    assert allocator.block_table("b") == parent + (child_cell,)
    allocator.free("a")
    assert all(allocator.refcount(cell) == 1 for cell in parent) and allocator.refcount(parent_cell) == 0


def test_micro_batches_are_read_back_in_order() -> None:
    allocator = unified_cache_micro_batches(SPEC)
    assert allocator.admit("a", (), PROMPT).block_table == (0, 1, 2, 3, 4)  # three micro-batches: 2 + 2 + 1
    assert [slot.block for slot in allocator.grow("a", (1, 2, 3)).slots] == [5, 6, 7]


def test_rollback_drops_the_tail_and_the_next_decode_matches_a_fresh_one() -> None:
    """After ``seq_rm`` of the tail, a grow attends to the kept cells only: its logits equal those of a fresh
    contiguous decode of the kept tokens and the new one (the adapter checks it on every decode)."""
    allocator = unified_cache(SPEC)
    table = allocator.admit("a", (), PROMPT).block_table
    allocator.rollback("a", 2)
    assert allocator.block_table("a") == table[:3]
    assert allocator.refcount(table[3]) == 0
    allocator.grow("a", (3, 1))
    assert len(allocator.block_table("a")) == 5


@pytest.mark.parametrize("factory", [unified_cache, unified_cache_micro_batches], ids=lambda factory: factory.__name__)
def test_a_full_cache_refuses_and_changes_nothing(factory) -> None:
    """Refused whole, micro-batches or not: llama.cpp places every micro-batch before it computes any."""
    allocator = factory(SPEC)
    allocator.admit("a", (), (1,) * 10)
    before = (allocator.block_table("a"), sorted(allocator.free_blocks()))
    with pytest.raises(OutOfBlocks):
        allocator.admit("b", (), (2,) * 7)
    with pytest.raises(OutOfBlocks):
        allocator.grow("a", (0,) * 7)
    assert (allocator.block_table("a"), sorted(allocator.free_blocks())) == before
    allocator.grow("a", (0,) * 6)  # exactly the six cells left: never one of the ballast's
    assert not allocator.free_blocks()


def test_memory_clear_empties_the_cache_the_reference_decodes_into() -> None:
    """The recomputations the logits are checked against run in a second context cleared before each use
    (``llama_memory_clear``): clear must leave no cell and no sequence behind."""
    context = Context(256, 4)
    context.decode(0, PROMPT, 0)
    context.seq_cp(0, 1, -1, -1)
    assert [cell.pos for cell in context.used_cells()] == [0, 1, 2, 3, 4]
    context.clear()
    assert context.used_cells() == ()
    assert (context.pos_min(0), context.pos_max(0), context.pos_max(1)) == (-1, -1, -1)
    assert context.decode(0, PROMPT[:2], 0).written == (0, 1)  # the search starts again at cell 0


def test_misuse_is_refused_with_the_contract_errors() -> None:
    allocator = unified_cache(SPEC)
    allocator.admit("a", (), PROMPT)
    with pytest.raises(UnknownSequence):
        allocator.grow("nobody", (1,))
    with pytest.raises(InvalidArgument):
        allocator.rollback("a", len(PROMPT))
    allocator.preempt("a")
    with pytest.raises(UnknownSequence):
        allocator.grow("a", (1,))
    assert not allocator.admit("a", (), PROMPT).num_cached_tokens


def test_blocks_of_several_tokens_are_refused() -> None:
    with pytest.raises(ValueError, match="block_size must be 1"):
        unified_cache(PoolSpec(block_size=4, num_blocks=16))


# -- each check the adapter makes, shown to fail ---------------------------------------------------------------


class _ForkCopiesAllButTheLastCell(LlamaCppKVCache):
    """``seq_cp`` over positions [0, len - 1): the child misses the parent's last cell."""

    def fork(self, parent, child):
        context = self._context
        real = context.seq_cp
        context.seq_cp = lambda src, dst, p0, p1: real(src, dst, 0, len(self._seqs[parent].tokens) - 1)
        try:
            return super().fork(parent, child)
        finally:
            del context.seq_cp


def test_a_seq_cp_with_the_wrong_range_is_caught_by_the_cell_list() -> None:
    allocator = _ForkCopiesAllButTheLastCell(SPEC)
    allocator.admit("a", (), PROMPT)
    with pytest.raises(AllocatorError, match=r"#244 in index order \(cell 244\) holds position 4 of seq ids \[0\], "):
        allocator.fork("a", "b")


class _RollbackKeepsOneTokenTooMany(LlamaCppKVCache):
    """``seq_rm`` from one position too late, and the adapter's picture following the same mistake: the cells
    agree, the sequence's position range does not."""

    def rollback(self, seq, num_tokens):
        state = self._seqs[seq]
        keep = len(state.tokens) - num_tokens
        self._context.seq_rm(state.seq_id, keep + 1, -1)
        self._drop(state.seq_id, keep + 1)
        del state.tokens[keep:]
        self._verify(f"rollback({seq!r}, {num_tokens})")


def test_a_seq_rm_with_the_wrong_range_is_caught_by_the_position_range() -> None:
    allocator = _RollbackKeepsOneTokenTooMany(SPEC)
    allocator.admit("a", (), PROMPT)
    with pytest.raises(AllocatorError, match=r"seq_pos_min/max of 'a' \(seq 0\) are \(0, 3\)"):
        allocator.rollback("a", 2)


def test_kvfuzz_catches_a_rollback_that_keeps_a_dropped_cell_in_the_table() -> None:
    """The same wrong ``seq_rm`` with the check left out: the table keeps a cell past the sequence's length, and
    kvfuzz's engine reports it."""

    class Unchecked(_RollbackKeepsOneTokenTooMany):
        def _verify(self, call):
            pass

    engine = Engine(Unchecked(SPEC), CONFIG)
    engine.admit("a", (), PROMPT)
    engine.step()
    with pytest.raises(InvariantViolation):
        engine.rollback("a", 2)


class _MisreadsTheWrittenCells(LlamaCppKVCache):
    """Reads each written cell one too high: the cells keep their order, so the state API's list agrees; the
    attention mask does not."""

    def _written(self, op, seq, seq_id, decoded, start):
        shifted = Decoded(decoded.status, tuple(cell + 1 for cell in decoded.written), decoded.visible, decoded.logits)
        super()._written(op, seq, seq_id, shifted, start)


def test_cells_misread_are_caught_by_the_attention_mask() -> None:
    allocator = _MisreadsTheWrittenCells(SPEC)
    with pytest.raises(
        AllocatorError,
        match=r"attention mask reads cells \[240, 241, 242, 243, 244\], but the sequence's cells are \[241, ",
    ):
        allocator.admit("a", (), PROMPT)


class _DecodesTheWrongTokens(LlamaCppKVCache):
    """Decodes each new token as the next id (mod the vocabulary): positions, cells and mask all agree, and only
    the K/V, hence the logits, are wrong."""

    def _decode(self, op, seq, seq_id, tokens, start):
        return super()._decode(op, seq, seq_id, tuple((token + 1) % 16 for token in tokens), start)


def test_wrong_kv_are_caught_by_the_logits_against_a_fresh_decode() -> None:
    allocator = _DecodesTheWrongTokens(SPEC)
    with pytest.raises(AllocatorError, match="logits differ by .* from a fresh contiguous decode"):
        allocator.admit("a", (), PROMPT)
