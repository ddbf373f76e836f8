"""On a machine without CUDA (or with its GPUs hidden), asking for CUDA is a usage error: exit status 2 and one line on
stderr, before any work, whether it is the pools' device or a CUDA-only attention kernel."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from factories import kvfuzz

ROOT = Path(__file__).resolve().parents[1]
# This tree first, and no GPU visible even where one is: the run must behave as on a CPU-only machine.
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}


def test_pools_on_cuda_are_refused_in_one_line(tmp_path: Path) -> None:
    done = kvfuzz("run", "--device", "cuda", "--examples", "1", cwd=tmp_path, env=ENV)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "kvfuzz: --device 'cuda': torch sees no CUDA device here (torch.cuda.is_available() is False)"
    ]
    assert not (tmp_path / "corpus").exists()


@pytest.mark.parametrize("kernel", ["flex-compiled", "flashinfer", "flashinfer-prefill"])
def test_a_cuda_only_kernel_on_cpu_is_refused_in_one_line(tmp_path: Path, kernel: str) -> None:
    done = kvfuzz("run", "--kernel", kernel, "--examples", "1", cwd=tmp_path, env=ENV)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith(f"kvfuzz: --kernel {kernel} runs on CUDA only"), line
