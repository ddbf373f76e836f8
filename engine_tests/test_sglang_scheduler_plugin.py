"""The pytest plugin searching SGLang's scheduling (``pytest --kvfuzz-scheduler sglang``): a clean SGLang passes
under small bounds, and a seeded bug (a radix hit's suffix written over the shared prefix, as in
test_sglang_scheduler_traces.py) fails the item, its trace saved in ``--kvfuzz-corpus``.

Runs in SGLang's environment (``scripts/third_party_env.sh sglang``; CI runs it there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvfuzz.scheduler.trace import load

SEEDED = """
import pytest

from engine_tests.test_sglang_scheduler_traces import _suffix_written_over_the_prefix

_suffix_written_over_the_prefix(pytest.MonkeyPatch())
"""
"""The seeded bug of test_sglang_scheduler_traces.py (a radix hit's suffix written over the shared prefix), as a
conftest.py that keeps it for the whole session."""


def _pytest(directory: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--kvfuzz-scheduler", "sglang"]
    return subprocess.run(
        [*command, *arguments], cwd=directory, env=environment, capture_output=True, text=True, timeout=600
    )


def test_a_clean_sglang_passes_and_a_seeded_bug_fails_the_item_with_its_trace_saved(tmp_path: Path) -> None:
    corpus = tmp_path / "found"
    bounds = ("--kvfuzz-examples", "40", "--kvfuzz-steps", "30", "--kvfuzz-corpus", str(corpus))
    clean = _pytest(tmp_path, *bounds)
    assert clean.returncode == 0 and "1 passed" in clean.stdout, clean.stdout + clean.stderr
    (tmp_path / "conftest.py").write_text(SEEDED)
    seeded = _pytest(tmp_path, *bounds)
    assert seeded.returncode == 1 and "1 failed" in seeded.stdout, seeded.stdout + seeded.stderr
    assert "kvfuzz[scheduler:sglang]" in seeded.stdout
    traces = sorted(corpus.glob("sglang-*.json"))
    assert traces and load(traces[-1]).failure.check in ("exclusive", "content")
