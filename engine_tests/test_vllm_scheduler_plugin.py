"""The pytest plugin searching vLLM's scheduler (``pytest --kvfuzz-scheduler vllm-v1``): a clean vLLM passes under
the ci profile's bounds, and a seeded bug (a prefix hit that takes no reference, the accounting check's) fails the
item with its check, program and explanation, its trace saved in ``--kvfuzz-corpus`` and replaying there.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvfuzz.scheduler.trace import load

SEEDED = "from vllm.v1.core.block_pool import BlockPool\nBlockPool.touch = lambda self, blocks: None\n"
"""The seeded bug as a conftest.py, as in test_vllm_scheduler_traces.py."""


def _pytest(directory: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--kvfuzz-scheduler", "vllm-v1"]
    return subprocess.run(
        [*command, *arguments], cwd=directory, env=environment, capture_output=True, text=True, timeout=600
    )


def test_a_clean_vllm_passes_and_a_seeded_bug_fails_the_item_with_its_trace_saved(tmp_path: Path) -> None:
    corpus = tmp_path / "found"
    bounds = ("--kvfuzz-examples", "20", "--kvfuzz-steps", "30", "--kvfuzz-corpus", str(corpus))
    clean = _pytest(tmp_path, *bounds)
    assert clean.returncode == 0 and "1 passed" in clean.stdout, clean.stdout + clean.stderr
    assert not corpus.exists() or not list(corpus.glob("*.json"))
    (tmp_path / "conftest.py").write_text(SEEDED)
    seeded = _pytest(tmp_path, *bounds)
    assert seeded.returncode == 1 and "1 failed" in seeded.stdout, seeded.stdout + seeded.stderr
    assert "kvfuzz[scheduler:vllm-v1]" in seeded.stdout and "accounting" in seeded.stdout
    assert "replay it with: kvfuzz replay" in seeded.stdout
    traces = sorted(corpus.glob("*.json"))
    assert traces and load(traces[-1]).failure.check == "accounting"
