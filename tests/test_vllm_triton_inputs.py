"""The vllm-triton kernel without vLLM: the metadata it builds from kvfuzz's tables (pure torch), and its refusal
where vLLM or Triton is absent. The kernel itself runs in the vLLM environment (engine_tests/test_vllm_triton.py)."""

from __future__ import annotations

import importlib.util

import torch
from test_bad_input import usage_error

from kvfuzz.allocator.types import NULL_BLOCK
from kvfuzz.kernels import PagedBatch
from kvfuzz.kernels.vllm_metadata import TABLE_PAD, group_rows, launches


def batch(tables, starts, lengths, block_sizes=()) -> PagedBatch:
    rows = len(tables)
    pool = torch.zeros(16 * 4, 1, 1, 2)
    return PagedBatch(
        [f"s{i}" for i in range(rows)], tables, starts, lengths, torch.zeros(rows, 1, 1, 2), pool, pool, 4, block_sizes
    )


def test_one_launch_per_block_size_and_window_each_row_once() -> None:
    """Rows 1 and 3 read windows of 5 and 3; row 0 (length 3, from 0) fits in the window of 5 and joins it; row 2
    (length 9, from 0) fits in none and reads unwindowed; row 4 holds 2 tokens per block: its own launch."""
    b = batch([(1,), (2, 3, 4), (5, 6, 7), (8, 9), (10, 11)], (0, 6, 0, 4, 0), (3, 11, 9, 7, 3), (4, 4, 4, 4, 2))
    assert group_rows(b) == {(4, 5): [0, 1], (4, 3): [3], (4, None): [2], (2, None): [4]}
    plan = {(launch.tokens_per_block, launch.window): launch for launch in launches(b)}
    assert sorted(row for launch in plan.values() for row in launch.rows) == [0, 1, 2, 3, 4]
    assert plan[4, 5].window_size == (4, 0)  # vLLM's (sliding_window - 1, 0) for a causal window
    assert plan[4, None].window_size == (-1, -1)
    assert plan[4, 5].seqused_k.tolist() == [3, 11]
    assert plan[4, 5].cu_seqlens_q.tolist() == [0, 1, 2]  # one query token per row
    assert plan[4, 5].max_seqlen_k == 11


def test_tables_are_int32_zero_padded_and_null_blocks_read_as_block_0() -> None:
    """vLLM's block tables are zero-filled int32 and its null block is block 0; kvfuzz's NULL_BLOCK (a block a
    sliding window dropped) becomes 0. The width covers the longest row rounded up to TABLE_PAD positions."""
    (launch,) = launches(batch([(NULL_BLOCK, 7, 3), (9,)], (5, 0), (10, 3)))
    assert launch.window == 5 and launch.rows == (0, 1)
    table = launch.block_table
    assert table.dtype == torch.int32 and table.shape == (2, TABLE_PAD // 4)
    assert table[0, :4].tolist() == [0, 7, 3, 0] and table[1, :2].tolist() == [9, 0]


def test_rows_of_different_windows_do_not_share_a_launch() -> None:
    plan = launches(batch([(1, 2, 3), (4, 5, 6)], (5, 7), (10, 10)))
    assert sorted((launch.window, launch.rows) for launch in plan) == [(3, (1,)), (5, (0,))]


def test_run_without_vllm_is_a_usage_error_saying_what_is_missing(capsys, monkeypatch, tmp_path) -> None:
    """Where vLLM (or Triton) is not installed, ``kvfuzz run --kernel vllm-triton`` exits 2 with one line naming the
    package and how to install it, before any work. The lookup is made to fail here, so vLLM's presence does not
    matter."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    line = usage_error(capsys, ["run", "--kernel", "vllm-triton", "--corpus", str(tmp_path / "c")])
    assert "kernel 'vllm-triton' needs vLLM 0.33.0" in line and "scripts/third_party_env.sh vllm" in line
    present = {"vllm": find_spec("torch"), "triton": None}  # vLLM there (any spec will do), Triton not
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: present[name] if name in present else find_spec(name, *a)
    )
    line = usage_error(capsys, ["run", "--kernel", "vllm-triton", "--corpus", str(tmp_path / "c")])
    assert "needs Triton" in line and "kvfuzz[triton]" in line
    assert not (tmp_path / "c").exists()
