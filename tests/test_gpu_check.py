"""scripts/gpu_check.py, the prepared GPU check, as far as a CPU machine can run it: its dry run (``--device cpu``)
checks, reports kernels and allocators it cannot run as unavailable with their reason, and exits nonzero when a
check fails; asked for CUDA where there is none, it exits 2 with one line before any work."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"

BROKEN = """
from kvfuzz.allocator.paged import PagedAllocator


class AdmitsNothing(PagedAllocator):
    def admit(self, seq, namespace, tokens):
        raise RuntimeError("broken on purpose")


def factory(spec):
    return AdmitsNothing(spec.block_size, spec.num_blocks, spec.num_host_blocks)
"""


def gpu_check(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "ignore", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.mark.slow
def test_the_dry_run_checks_reports_what_is_unavailable_and_fails_on_a_broken_allocator(tmp_path: Path) -> None:
    (tmp_path / "broken_for_gpu_check.py").write_text(BROKEN)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    vllm_v1 = "kvfuzz.adapters.vllm_v1:kv_cache_manager"
    done = gpu_check(
        "--device",
        "cpu",
        "--budget",
        "120",
        "--kernels",
        "gather,flashinfer,flex-compiled,no-such-kernel",
        "--allocators",
        f"kvfuzz,broken_for_gpu_check:factory,{vllm_v1}",
        env=env,
    )
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    rows = {tuple(line.split()[:3]): line for line in out.splitlines() if line.startswith(("pools", "kernels"))}
    assert rows[("pools", "kvfuzz", "gather")].endswith("passed")
    assert rows[("kernels", "kvfuzz", "gather")].endswith("passed")
    assert "FAILED: crash" in rows[("kernels", "broken_for_gpu_check:factory", "gather")]
    assert "unavailable: --kernel flashinfer runs on CUDA only" in rows[("kernels", "*", "flashinfer")]
    assert "unavailable: --kernel flex-compiled runs on CUDA only" in rows[("kernels", "*", "flex-compiled")]
    assert "unavailable: no attention kernel named 'no-such-kernel'" in rows[("kernels", "*", "no-such-kernel")]
    if importlib.util.find_spec("vllm") is None:
        assert "unavailable: vllm is not installed" in rows[("kernels", vllm_v1, "*")]
    else:
        assert rows[("kernels", vllm_v1, "gather")].endswith("passed")
    assert "1 of" in out and "checks failed or did not finish" in out


def test_cuda_asked_for_without_cuda_is_one_line_and_exit_2() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = gpu_check(env=env, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "gpu_check: --device cuda, but torch sees no CUDA device here (use --device cpu for the dry run)"
    ]
