"""The ``sglang-triton`` kernel without SGLang: the inputs it builds from kvfuzz's block tables (SGLang's
``req_to_token``, ``kv_indptr``, the split between SGLang's decode and extend kernels), Triton's interpreter chosen
before Triton loads, and the usage error where SGLang is not installed. The kernel itself runs in SGLang's
environment: engine_tests/test_sglang_triton.py."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvfuzz.allocator.types import NULL_BLOCK
from kvfuzz.kernels import KernelUnavailable, PagedBatch, triton_setup
from kvfuzz.kernels.sglang_triton import indptr, req_to_token, split, uses_extend
from kvfuzz.reference.content import ModelShape
from tests.factories import kvfuzz


def batch(tables, starts, lengths, block_size=4, block_sizes=()) -> PagedBatch:
    pools = torch.zeros(16 * block_size, 1, 1, 2)
    return PagedBatch(
        [f"s{row}" for row in range(len(tables))],
        tables,
        starts,
        lengths,
        torch.zeros(len(tables), 1, 1, 2),
        pools,
        pools,
        block_size,
        block_sizes,
    )


def test_req_to_token_holds_each_read_positions_slot_through_scattered_tables() -> None:
    table = req_to_token(batch([[5, 2, 9], [7]], [0, 0], [10, 3]))
    assert table.tolist() == [
        [20, 21, 22, 23, 8, 9, 10, 11, 36, 37],
        [28, 29, 30, 0, 0, 0, 0, 0, 0, 0],  # past its length: never read
    ]


def test_req_to_token_skips_positions_before_the_window_and_a_groups_smaller_blocks() -> None:
    windowed = req_to_token(batch([[NULL_BLOCK, 3, 1]], [6], [10]))
    assert windowed.tolist() == [[0, 0, 0, 0, 0, 0, 14, 15, 4, 5]]
    # A KV-cache group whose blocks hold 2 tokens uses the first 2 of each block's 4 rows.
    grouped = req_to_token(batch([[3, 1, 6]], [0], [5], block_sizes=[2]))
    assert grouped.tolist() == [[12, 13, 4, 5, 24]]


def test_rows_split_between_the_two_kernels_by_length_and_read_their_window() -> None:
    decode, extend = split(batch([[0], [1, 2], [3, 4, 5], [NULL_BLOCK, 6, 7]], [0, 0, 0, 5], [1, 6, 9, 12]))
    assert (decode.rows, decode.kv_starts, decode.kv_lens) == ([0, 2], [0, 0], [1, 9])
    # The extend kernel's last position is its one-token chunk, not part of the prefix read through kv_indices.
    assert (extend.rows, extend.kv_starts, extend.kv_lens) == ([1, 3], [0, 5], [5, 6])
    assert [uses_extend(length) for length in (1, 2, 3, 4)] == [False, True, False, True]


def test_indptr_offsets_consecutive_runs() -> None:
    assert indptr([3, 0, 5]).tolist() == [0, 3, 3, 8]
    assert indptr([3, 0, 5]).dtype == torch.int32


def test_the_interpreter_is_chosen_on_cpu_before_triton_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(triton_setup.INTERPRET, "0")  # not "1", and undone after the test
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    triton_setup.interpret_on_cpu("sglang-triton", ModelShape())
    assert triton_setup.interpreting()


def test_triton_imported_without_the_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(triton_setup.INTERPRET, "0")  # not "1", and undone after the test
    monkeypatch.setitem(sys.modules, "triton", sys)  # stands for a Triton already imported
    with pytest.raises(KernelUnavailable, match="Triton was imported before TRITON_INTERPRET=1"):
        triton_setup.interpret_on_cpu("sglang-triton", ModelShape())


def test_bfloat16_pools_are_refused_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(triton_setup.INTERPRET, "1")
    with pytest.raises(KernelUnavailable, match="cannot run bfloat16 pools: use float32 or float16"):
        triton_setup.interpret_on_cpu("sglang-triton", ModelShape(dtype=torch.bfloat16))


def test_importing_the_kernels_imports_neither_sglang_nor_triton() -> None:
    probe = "import sys, kvfuzz.kernels; print(sorted({'sglang', 'triton'} & set(sys.modules)))"
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert shown.stdout.strip() == "[]"


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_run_without_sglang_is_a_one_line_usage_error(tmp_path: Path) -> None:
    refused = kvfuzz("run", "--kernel", "sglang-triton", cwd=tmp_path)
    assert refused.returncode == 2 and not refused.stdout
    assert refused.stderr.count("\n") == 1
    assert "kernel 'sglang-triton' needs SGLang (0.5.22 or 0.5.23) and Triton" in refused.stderr
    assert "No module named 'sglang'" in refused.stderr
