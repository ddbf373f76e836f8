"""FlashInfer's page tables built from kvfuzz's block tables (kvfuzz/kernels/page_tables.py), checked on CPU against
hand-computed tables and against FlashInfer's documented reading of them; and the CUDA-only kernels refusing to be
made where they cannot run, with one line."""

from __future__ import annotations

import importlib.abc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvfuzz.allocator import paged_allocator
from kvfuzz.allocator.types import NULL_BLOCK
from kvfuzz.engine import MachineConfig
from kvfuzz.kernels import GatherKernel, KernelUnavailable, PagedBatch, make_kernel
from kvfuzz.kernels.flashinfer import layer_pages
from kvfuzz.kernels.page_tables import PageTables, page_tables
from kvfuzz.reference.attention import attend
from kvfuzz.reference.content import ModelShape

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ModelShape(num_layers=2, num_kv_heads=2, num_query_heads=4, head_dim=8)


def batch_of(tables, starts, lengths, block_size: int, num_blocks: int = 10, block_sizes=()) -> PagedBatch:
    torch.manual_seed(0)
    rows = len(tables)
    pool = (num_blocks * block_size, *SHAPE.kv_row_shape)
    return PagedBatch(
        tuple(f"s{row}" for row in range(rows)),
        tables,
        starts,
        lengths,
        torch.rand(rows, SHAPE.num_layers, SHAPE.num_query_heads, SHAPE.head_dim),
        torch.rand(pool),
        torch.rand(pool),
        block_size,
        block_sizes,
    )


def test_scattered_tables_list_their_pages_in_order_with_the_last_page_s_fill() -> None:
    batch = batch_of([(7, 3, 9), (0,), (5, 1, 4, 6)], (0, 0, 0), (10, 3, 16), block_size=4)
    assert page_tables(batch) == (
        PageTables(
            rows=(0, 1, 2),
            page_size=4,
            window_left=-1,
            kv_indptr=(0, 3, 4, 8),
            kv_indices=(7, 3, 9, 0, 5, 1, 4, 6),
            kv_last_page_len=(2, 3, 4),  # 10 = 2 * 4 + 2; 3; 16 = 3 * 4 + 4 (a full last page is 4, never 0)
        ),
    )


def test_sliding_windows_skip_dropped_blocks_and_trim_the_first_page() -> None:
    """Row 0 reads positions 9..13: blocks 0 and 1 were dropped (NULL_BLOCK) and are not listed; its pages start at
    block index 2 (positions 8..11), so FlashInfer sees 6 tokens and the window of 4 before the last trims
    position 8. Row 1 reads 8..11, a window starting on a page boundary. Row 2 reads all: no window."""
    null = NULL_BLOCK
    batch = batch_of([(null, null, 5, 2), (null, null, 3), (1, 8)], (9, 8, 0), (14, 12, 5), block_size=4)
    assert page_tables(batch) == (
        PageTables((2,), 4, -1, (0, 2), (1, 8), (1,)),
        PageTables((1,), 4, 3, (0, 1), (3,), (4,)),
        PageTables((0,), 4, 4, (0, 2), (5, 2), (2,)),
    )


def test_groups_of_smaller_blocks_get_their_own_page_size() -> None:
    """Pools of 8 rows per block; rows 0 and 2 belong to a KV-cache group whose blocks hold 4 tokens."""
    batch = batch_of([(2, 5), (1,), (0, 3, 4)], (0, 0, 0), (6, 8, 9), block_size=8, block_sizes=(4, 8, 4))
    assert page_tables(batch) == (
        PageTables((0, 2), 4, -1, (0, 2, 5), (2, 5, 0, 3, 4), (2, 1)),
        PageTables((1,), 8, -1, (0, 1), (1,), (8,)),
    )


@pytest.mark.parametrize("bad", [NULL_BLOCK, 10, -2])
def test_a_block_outside_the_pool_in_the_read_range_is_refused(bad: int) -> None:
    batch = batch_of([(3, bad)], (0,), (6,), block_size=4, num_blocks=10)
    with pytest.raises(ValueError, match=f"row 0 would read block {bad}"):
        page_tables(batch)


def test_a_table_too_short_for_its_length_is_refused() -> None:
    with pytest.raises(ValueError, match="row 0: its table has 1 blocks"):
        page_tables(batch_of([(3,)], (0,), (6,), block_size=4))


def test_layer_pages_are_views_of_each_block_s_first_rows() -> None:
    pool = torch.arange(6 * 8 * 2 * 3 * 4, dtype=torch.float32).reshape(6 * 8, 2, 3, 4)  # 6 blocks of 8 rows
    pages = layer_pages(pool, layer=1, block_size=8, page_size=4)
    assert pages.shape == (6, 4, 3, 4)
    assert torch.equal(pages[5, 3], pool[5 * 8 + 3, 1])
    assert torch.equal(pages[2, 0], pool[16, 1])
    pool[9, 1, 2, 3] = -1.0  # block 1, row 1, layer 1: the view sees the write
    assert pages[1, 1, 2, 3] == -1.0


def flashinfer_as_documented(batch: PagedBatch) -> torch.Tensor:
    """FlashInfer's documented reading of its page tables, in plain torch: row i's K/V are the concatenation of its
    listed pages, cut to ``(pages - 1) * page_size + last_page_len`` tokens, of which ``window_left + 1`` (all if -1)
    end with the last; then the reference's attention."""
    out = torch.empty(batch.queries.shape)
    for tables in page_tables(batch):
        for index, row in enumerate(tables.rows):
            pages = list(tables.kv_indices[tables.kv_indptr[index] : tables.kv_indptr[index + 1]])
            kv_len = (len(pages) - 1) * tables.page_size + tables.kv_last_page_len[index]
            first = 0 if tables.window_left < 0 else kv_len - 1 - tables.window_left
            per_layer = []
            for pool in (batch.keys, batch.values):
                layers = [
                    layer_pages(pool, layer, batch.block_size, tables.page_size)[pages].flatten(0, 1)[first:kv_len]
                    for layer in range(pool.shape[1])
                ]
                per_layer.append(torch.stack(layers, dim=1).unsqueeze(0))
            keys, values = per_layer
            out[row] = attend(batch.queries[row : row + 1], keys, values, torch.tensor([kv_len - first]))[0]
    return out


def test_the_tables_read_as_flashinfer_documents_give_the_gather_kernel_s_result() -> None:
    """Scattered tables, windows with dropped blocks, and a group of smaller blocks in one batch."""
    null = NULL_BLOCK
    batch = batch_of(
        [(7, 3, 9), (null, null, 5, 2), (2, 5), (null, 0, 4)],
        (0, 9, 0, 5),
        (10, 14, 4, 10),
        block_size=4,
        block_sizes=(4, 4, 2, 4),
    )
    expected = GatherKernel().attend(batch)
    assert torch.allclose(flashinfer_as_documented(batch), expected, atol=1e-6, rtol=0)
    shifted = batch_of(
        [(7, 3, 8), (null, null, 5, 2), (2, 5), (null, 0, 4)],
        (0, 9, 0, 5),
        (10, 14, 4, 10),
        4,
        block_sizes=(4, 4, 2, 4),
    )
    assert not torch.allclose(flashinfer_as_documented(shifted)[0], expected[0], atol=1e-3)


@pytest.mark.parametrize("name", ["flashinfer", "flashinfer-prefill", "flex-compiled"])
def test_cuda_only_kernels_refuse_a_cpu_pool_in_one_line(name: str) -> None:
    allocator = paged_allocator(MachineConfig().pool_spec())
    with pytest.raises(KernelUnavailable, match="runs on CUDA only") as raised:
        make_kernel(name, allocator, ModelShape())
    assert "\n" not in str(raised.value)


def cuda_shape(monkeypatch: pytest.MonkeyPatch, **fields) -> ModelShape:
    """A CUDA model shape on this machine, CUDA or not: the kernels' checks below run before anything is allocated."""
    with monkeypatch.context() as patched:
        patched.setattr(torch.cuda, "is_available", lambda: True)
        return ModelShape(device="cuda", **fields)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"head_dim": 64, "dtype": torch.float32}, "needs --dtype float16 or bfloat16"),
        ({"head_dim": 8, "dtype": torch.bfloat16}, "needs --head-dim 64, 128, 256, not 8"),
    ],
)
def test_flashinfer_states_the_dtypes_and_head_dims_it_takes(monkeypatch, fields, says: str) -> None:
    allocator = paged_allocator(MachineConfig().pool_spec())
    with pytest.raises(KernelUnavailable, match=says):
        make_kernel("flashinfer", allocator, cuda_shape(monkeypatch, **fields))


def test_flashinfer_absent_is_named_as_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # an import of it raises ImportError, installed or not
    shape = cuda_shape(monkeypatch, head_dim=64, dtype=torch.bfloat16)
    with pytest.raises(KernelUnavailable, match="needs the flashinfer package"):
        make_kernel("flashinfer-prefill", paged_allocator(MachineConfig().pool_spec()), shape)


def test_flashinfer_failing_to_load_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    class FailsToLoad(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "flashinfer":
                raise RuntimeError("CUDA 13.0 driver,\n 12.8 runtime")
            return None

    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    monkeypatch.setattr(sys, "meta_path", [FailsToLoad(), *sys.meta_path])
    shape = cuda_shape(monkeypatch, head_dim=128, dtype=torch.float16)
    with pytest.raises(KernelUnavailable) as raised:
        make_kernel("flashinfer", paged_allocator(MachineConfig().pool_spec()), shape)
    assert (
        str(raised.value)
        == "--kernel flashinfer: importing flashinfer raised RuntimeError: CUDA 13.0 driver, 12.8 runtime"
    )


def test_flex_compiled_without_triton_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # find_spec then reports it absent, installed or not
    with pytest.raises(KernelUnavailable, match="needs the triton package"):
        make_kernel("flex-compiled", paged_allocator(MachineConfig().pool_spec()), cuda_shape(monkeypatch))


def test_importing_the_kernels_loads_neither_flashinfer_nor_the_cuda_only_modules() -> None:
    script = (
        "import sys, kvfuzz.kernels\n"
        "loaded = [m for m in ('flashinfer', 'kvfuzz.kernels.flashinfer', 'kvfuzz.kernels.flex_compiled') "
        "if m in sys.modules]\n"
        "print(loaded)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
