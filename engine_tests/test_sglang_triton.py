"""Invariant 2 through SGLang's own Triton decode and extend attention (kvfuzz.kernels.sglang_triton), in Triton's
interpreter on CPU.

Runs in SGLang's environment (``scripts/third_party_env.sh sglang``; CI runs it there): without SGLang and Triton the
kernel is refused loudly rather than skipped. The interpreter must be chosen before Triton is first imported, so this
module prepares the kernel before it imports anything of SGLang's.

The broken table: no zoo variant was found whose slip reaches invariant 2 before invariant 1 (every read position's
K/V, bit for bit) catches it, so the closest honest thing is shown: a block table corrupted at the kernel's input
(its last entry pointing at another block), caught as invariant 2 through SGLang's kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvfuzz.kernels import prepare_kernel
from kvfuzz.reference.content import ModelShape

prepare_kernel("sglang-triton", ModelShape())  # Triton's interpreter, before SGLang (and so Triton) is imported

import attrs  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from kvfuzz.allocator import paged_allocator  # noqa: E402
from kvfuzz.allocator.types import NULL_BLOCK  # noqa: E402
from kvfuzz.engine import Engine, Invariant, InvariantViolation, MachineConfig  # noqa: E402
from kvfuzz.kernels import PagedBatch, compare, make_kernel  # noqa: E402
from kvfuzz.kernels.gather import GatherKernel  # noqa: E402
from kvfuzz.kernels.sglang_triton import SGLangTritonKernel, split  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def hand_built(dtype: torch.dtype) -> PagedBatch:
    """Four rows over scattered tables of 4-slot blocks, 1 KV head for 4 query heads (GQA), two layers: rows of odd
    length go to SGLang's decode kernel (one past its 32-token split), of even length to its extend kernel (one under a
    sliding window whose first block is null)."""
    generator = torch.Generator().manual_seed(7)

    def uniform(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=generator) * 2 - 1).to(dtype)

    tables = [[9, 2, 14], [3, 11, 0, 7, 12, 1, 5, 8, 10, 13], [6, 4], [NULL_BLOCK, 15, 16]]
    return PagedBatch(
        ["a", "b", "c", "d"], tables, [0, 0, 0, 5], [11, 37, 8, 12], uniform(4, 2, 4, 8),
        uniform(17 * 4, 2, 1, 8), uniform(17 * 4, 2, 1, 8), 4,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sglangs_kernels_match_the_reference_on_a_hand_built_batch(dtype: torch.dtype) -> None:
    batch = hand_built(dtype)
    decode, extend = split(batch)
    assert decode.rows == [0, 1] and extend.rows == [2, 3]  # both of SGLang's kernels run
    kernel = make_kernel("sglang-triton", paged_allocator(MachineConfig().pool_spec()), ModelShape(dtype=dtype))
    paged, expected = kernel.attend(batch), GatherKernel().attend(batch)
    assert compare(paged, expected, kernel.tolerance(dtype)) is None
    # A table naming the wrong block for one position range is seen by each kernel.
    for row in (1, 3):
        tables = list(batch.tables)
        tables[row] = tables[row][:-1] + (4,)
        wrong = kernel.attend(attrs.evolve(batch, tables=tables))
        mismatch = compare(wrong, expected, kernel.tolerance(dtype))
        assert mismatch is not None and mismatch.row == row


def test_bfloat16_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="cannot run bfloat16 pools") as refused:
        make_kernel("sglang-triton", paged_allocator(MachineConfig().pool_spec()), ModelShape(dtype=torch.bfloat16))
    assert "\n" not in str(refused.value)


class CorruptedTableKernel(SGLangTritonKernel):
    """SGLang's kernels handed a broken table: each row's last block table entry points at the block after it."""

    def attend(self, batch: PagedBatch) -> torch.Tensor:
        tables = [table[:-1] + ((table[-1] + 1) % batch.num_blocks,) for table in batch.tables]
        return super().attend(attrs.evolve(batch, tables=tables))


def test_a_broken_table_is_caught_through_sglangs_kernels_as_invariant_2() -> None:
    config = MachineConfig(kernel="sglang-triton")
    engine = Engine(paged_allocator(config.pool_spec()), config)
    engine.checks.attention.kernel = CorruptedTableKernel(config.shape)
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("s0", (), (1, 2, 3, 0, 2))
        engine.step()
    assert caught.value.invariant is Invariant.ATTENTION
    assert "(sglang-triton kernel)" in caught.value.explain()


@pytest.mark.parametrize("allocator", ["kvfuzz", "kvfuzz.adapters.sglang:radix_cache"])
def test_a_short_run_passes_through_sglangs_kernels(allocator: str, tmp_path: Path) -> None:
    small = ["--layers", "1", "--kv-heads", "1", "--query-heads", "2"]  # GQA; the interpreter is slow
    # seed 2's first ten examples write and attend K/V on both allocators (measured: 79 and 129 tokens written); a
    # shorter derandomized run (2 examples of 8 steps) wrote none, so never reached the kernel
    run = ["run", "--allocator", allocator, "--kernel", "sglang-triton", "--examples", "10", "--steps", "30", *small]
    run += ["--seed", "2", "--json"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "kvfuzz.cli", *run],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert not summary["failed"]
    assert summary["operations"]["tokens written"] and summary["operations"]["step"]  # attention was checked
