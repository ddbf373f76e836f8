"""The adapter for PyTorch's own ``PagedAttention``: the contract mapped onto reserve/erase, atomic refusal, the
machine's verdicts, and the two library bugs kvfuzz finds in its attention path (kept as known bugs)."""

from __future__ import annotations

import pytest
import torch

from kvfuzz.adapters.torch_paged import TorchPagedAttention, paged_attention
from kvfuzz.allocator import OutOfBlocks, PoolSpec, SequenceExists, UnknownSequence
from kvfuzz.engine import Engine, Invariant, InvariantViolation, MachineConfig
from kvfuzz.kernels import GatherKernel, PagedBatch, compare, different_kernel_tolerance
from kvfuzz.reference.content import ModelShape
from kvfuzz.runner import run

SPEC = PoolSpec(block_size=4, num_blocks=8)


def snapshot(adapter: TorchPagedAttention) -> tuple:
    paged = adapter.paged
    return (
        paged.page_table.clone(),
        paged.capacity.clone(),
        paged.physical_to_logical.clone(),
        list(paged.empty_pages),
        dict(adapter.batch_of),
        dict(adapter.length),
    )


def same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def test_admit_grow_free_map_to_reserve_and_erase() -> None:
    adapter = paged_attention(SPEC)
    table = adapter.admit("s0", (), (1, 2, 3, 4, 5)).block_table
    assert len(table) == 2 and adapter.block_table("s0") == table and adapter.batch_of == {"s0": 0}
    assert not set(table) & set(adapter.free_blocks()) and all(adapter.refcount(b) == 1 for b in table)
    grown = adapter.grow("s0", (6, 7, 8, 9))
    table = adapter.block_table("s0")
    assert len(table) == 3
    assert [(s.block, s.offset) for s in grown.slots] == [(table[1], 1), (table[1], 2), (table[1], 3), (table[2], 0)]
    assert adapter.admit("s1", (), (1,)).block_table and adapter.batch_of["s1"] == 1
    adapter.preempt("s0")
    assert len(adapter.free_blocks()) == 7 and adapter.refcount(table[0]) == 0
    assert adapter.admit("s2", (), (1, 2)).block_table and adapter.batch_of["s2"] == 0  # the lowest free index
    adapter.free("s1")
    adapter.free("s2")
    assert sorted(adapter.free_blocks()) == list(range(8))


def test_exhaustion_is_out_of_blocks_and_changes_nothing() -> None:
    adapter = paged_attention(SPEC)
    adapter.admit("s0", (), tuple(range(20)))
    adapter.admit("s1", (), (1, 2, 3))
    before = snapshot(adapter)
    with pytest.raises(OutOfBlocks, match="requested 3 pages but there are only 2 empty pages") as refused:
        adapter.admit("s2", (), tuple(range(9)))
    assert refused.value.needed == 3 and refused.value.available == 2
    with pytest.raises(OutOfBlocks):
        adapter.grow("s1", tuple(range(10)))
    assert same(snapshot(adapter), before)


def test_misuse_is_refused_with_typed_errors() -> None:
    adapter = paged_attention(SPEC)
    adapter.admit("s0", (), (1,))
    before = snapshot(adapter)
    for call, error in [
        (lambda: adapter.admit("s0", (), (2,)), SequenceExists),
        (lambda: adapter.grow("nobody", (1,)), UnknownSequence),
    ]:
        with pytest.raises(error):
            call()
    assert same(snapshot(adapter), before)
    assert not hasattr(adapter, "rollback") and not hasattr(adapter, "fork")  # never declared: no stubs
    adapter.free("s0")
    with pytest.raises(UnknownSequence):
        adapter.free("s0")


@pytest.mark.parametrize("kernel", ["gather", "flex"])
def test_its_page_management_passes_the_machine(kernel: str) -> None:
    summary = run(paged_attention, MachineConfig(kernel=kernel), examples=30, steps=40)
    assert not summary.failed, summary.explanation
    ops = summary.operations
    assert ops["preempt"] and ops["readmit"] and ops["refused (out of blocks)"] and ops["misuse"]


# -- known library bugs in PagedAttention's attention path (torch 2.13.0) ------------------------------------------


def test_known_bug_erase_leaves_physical_to_logical_live() -> None:
    """``erase`` clears ``physical_to_logical[batch_idx][:, pages]``: indexing with a tensor makes a copy, so the
    erased pages still map to logical blocks of that batch index, and the converted mask_mod admits them for the
    next sequence given the index. kvfuzz's shrunk program: admit 9 tokens, free, admit 5, step."""
    adapter = paged_attention(SPEC)
    old = adapter.admit("s0", (), tuple(range(9))).block_table
    adapter.free("s0")
    new = adapter.admit("s1", (), tuple(range(5))).block_table
    stale = [page for page in old if page not in new]
    assert stale and all(int(adapter.paged.physical_to_logical[0, page]) >= 0 for page in stale)

    config = MachineConfig(kernel="allocator")
    h = Engine(paged_attention(config.pool_spec()), config)
    assert h.admit("s2", (), (3, 2, 1, 0, 3, 1, 0, 0, 3))
    h.free("s2")
    assert h.admit("s5", (), (3, 2, 1, 2, 2))
    with pytest.raises(InvariantViolation) as caught:
        h.step()
    assert caught.value.invariant is Invariant.ATTENTION and "(allocator kernel)" in caught.value.explain()


def test_known_bug_mask_mod_indexes_physical_to_logical_by_row_not_batch_index() -> None:
    """``convert_logical_block_mask(mask, batch_idx)`` gathers page-table rows by ``batch_idx``, but the mask_mod it
    builds looks up ``physical_to_logical[b]`` with ``b`` the block mask's row (attention-gym issue #189, same code).
    Attention for batch indices in order is right; for the same sequences in another order it is not."""
    shape = ModelShape()
    adapter = paged_attention(SPEC)
    adapter.admit("s0", (), tuple(range(5)))
    adapter.admit("s1", (), tuple(range(7)))
    torch.manual_seed(0)
    keys = torch.rand(SPEC.num_blocks * SPEC.block_size, *shape.kv_row_shape)
    values = torch.rand_like(keys)
    tolerance = different_kernel_tolerance(torch.float32)

    def attention_agrees(seqs: list[str]) -> bool:
        lengths, queries = [adapter.length[seq] for seq in seqs], torch.rand(2, 2, 4, 8)
        batch = PagedBatch(
            seqs, [adapter.block_table(seq) for seq in seqs], (0, 0), lengths, queries, keys, values, SPEC.block_size
        )
        ours = adapter.paged_attention(queries, keys, values, seqs, lengths, (0, 0))
        return compare(ours, GatherKernel().attend(batch), tolerance) is None

    assert attention_agrees(["s0", "s1"])
    assert not attention_agrees(["s1", "s0"])
