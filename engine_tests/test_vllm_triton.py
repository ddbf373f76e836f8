"""Invariant 2 through vLLM's own Triton unified attention (kvfuzz.kernels.vllm_triton), under Triton's interpreter.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``, which installs Triton 3.9.0 and einops beside
vLLM 0.33.0; CI runs it there): without them the kernel refuses and these tests fail loudly rather than skip.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

from kvfuzz.allocator.types import NULL_BLOCK
from kvfuzz.kernels import (
    GatherKernel,
    KernelUnavailable,
    PagedBatch,
    compare,
    make_kernel,
    prepare_kernel,
)
from kvfuzz.reference.content import ModelShape

# Before anything imports Triton or vLLM's triton_utils: Triton's interpreter is chosen when Triton is first imported.
prepare_kernel("vllm-triton", ModelShape())

from kvfuzz.allocator import paged_allocator  # noqa: E402
from kvfuzz.engine import Engine, Invariant, InvariantViolation, MachineConfig  # noqa: E402
from kvfuzz.kernels.vllm_triton import OP_MODULE, VllmTritonKernel  # noqa: E402

GQA = ModelShape(num_layers=2, num_kv_heads=2, num_query_heads=6, head_dim=8)


def hand_built(dtype: torch.dtype) -> PagedBatch:
    """Scattered tables over 16-row blocks (pool blocks 2 and 9 hold nobody's K/V: large values that must not leak
    in): row a crosses three blocks from 0; row b reads a window (positions 21..40) after a dropped block (NULL)
    whose table entry vLLM reads as its null block 0; row c holds 8 tokens per block (a KV-cache group of smaller
    blocks), so rows 8..15 of its blocks must not be read; row d is one token."""
    size, blocks = 16, 12
    torch.manual_seed(0)
    keys = (torch.rand(blocks * size, *GQA.kv_row_shape) * 2 - 1).to(dtype)
    values = (torch.rand(blocks * size, *GQA.kv_row_shape) * 2 - 1).to(dtype)
    for block in (2, 9):
        keys[block * size : (block + 1) * size] = values[block * size : (block + 1) * size] = 100.0
    for block in (4, 10):  # row c's blocks: their rows 8..15
        keys[block * size + 8 : (block + 1) * size] = values[block * size + 8 : (block + 1) * size] = 100.0
    tables = [(7, 3, 5), (NULL_BLOCK, 8, 1), (10, 4), (6,)]
    queries = (torch.rand(4, GQA.num_layers, GQA.num_query_heads, GQA.head_dim) * 2 - 1).to(dtype)
    return PagedBatch("abcd", tables, (0, 21, 0, 0), (40, 41, 13, 1), queries, keys, values, size, (16, 16, 8, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_vllms_kernel_matches_the_reference_on_hand_built_tables(dtype: torch.dtype) -> None:
    kernel = make_kernel("vllm-triton", paged_allocator(MachineConfig().pool_spec()), attrs.evolve(GQA, dtype=dtype))
    assert isinstance(kernel, VllmTritonKernel) and kernel.unified_attention.__module__ == OP_MODULE
    batch = hand_built(dtype)
    expected = GatherKernel().attend(batch)
    assert expected.abs().max() < 1  # the poisoned rows stayed out of the reference
    paged = kernel.attend(batch)
    assert compare(paged, expected, kernel.tolerance(dtype)) is None
    wrong = attrs.evolve(batch, tables=[(7, 3, 5), (NULL_BLOCK, 8, 2), (10, 4), (6,)])  # b's last block: poisoned
    mismatch = compare(kernel.attend(wrong), expected, kernel.tolerance(dtype))
    assert mismatch is not None and mismatch.row == 1


def test_vllms_split_kv_decode_path_matches_too() -> None:
    """The path vLLM's backend takes for small decode batches (16 softmax segments, then a reduction)."""
    shape = attrs.evolve(GQA, num_layers=1)  # one layer: this path costs the interpreter about three times more
    kernel = VllmTritonKernel(shape, split_kv=True)
    batch = hand_built(torch.float32)
    batch = attrs.evolve(batch, queries=batch.queries[:, :1], keys=batch.keys[:, :1], values=batch.values[:, :1])
    assert compare(kernel.attend(batch), GatherKernel().attend(batch), kernel.tolerance(torch.float32)) is None


def test_bfloat16_is_refused_on_cpu_in_one_line() -> None:
    """Triton's interpreter computes with numpy, which has no bfloat16: outputs come out near 1e8."""
    with pytest.raises(KernelUnavailable, match="interpreter, which cannot run bfloat16 pools") as refused:
        prepare_kernel("vllm-triton", ModelShape(dtype=torch.bfloat16))
    assert "\n" not in str(refused.value)


class CorruptedInputKernel(VllmTritonKernel):
    """vLLM's kernel handed a block table corrupted on its way in: every row's last block entry names the physical
    block before it, as a backend building its block table off by one would."""

    def attend(self, batch: PagedBatch) -> torch.Tensor:
        tables = [table[:-1] + ((table[-1] - 1) % batch.num_blocks,) for table in batch.tables]
        return super().attend(attrs.evolve(batch, tables=tables))


def test_a_broken_table_is_caught_through_vllms_kernel_as_invariant_2() -> None:
    """The closest honest case: no zoo variant's slip reaches invariant 2 before invariant 1 (which checks every
    read position's K/V bit for bit) catches it, so the table is corrupted at the kernel's input, where invariant 1,
    reading the allocator's correct tables, cannot see it; vLLM's kernel reads the wrong block and invariant 2 fails."""
    cfg = MachineConfig(block_size=4, num_blocks=12, kernel="vllm-triton")
    h = Engine(paged_allocator(cfg.pool_spec()), cfg)
    h.checks.attention.kernel = CorruptedInputKernel(cfg.shape)
    with pytest.raises(InvariantViolation) as caught:
        assert h.admit("s0", (), (1, 2, 3, 4, 5, 6))
        assert h.admit("s1", (), (7, 8, 9))
        h.step()
        h.free("s0")
        assert h.admit("s2", (), tuple(range(20, 31)))
        h.step()
    assert caught.value.invariant is Invariant.ATTENTION
    assert "(vllm-triton kernel)" in caught.value.explain()


@pytest.mark.parametrize(
    "allocator", ["kvfuzz.allocator.paged:paged_allocator", "kvfuzz.adapters.vllm_v1:kv_cache_manager_sliding_window"]
)
def test_a_short_run_passes_through_vllms_kernel(allocator: str, tmp_path: Path) -> None:
    """kvfuzz's allocator, and vLLM v1's own KV-cache manager (its sliding-window variant), each driven by the
    machine from the command line (which prepares the kernel before the allocator loads vLLM), with invariant 2
    computed by vLLM's kernel at every step (seed 2: some ten batches each, eight of vLLM's read a sliding window).
    One layer and one KV head (two query heads) keep the interpreter short."""
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "kvfuzz.cli", "run", "--allocator", allocator, "--kernel", "vllm-triton"]
        + ["--examples", "10", "--steps", "30", "--seed", "2", "--layers", "1", "--kv-heads", "1", "--query-heads", "2"]
        + ["--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert not summary["failed"]
    assert summary["operations"]["tokens written"] and summary["operations"]["step"]  # attention was checked
