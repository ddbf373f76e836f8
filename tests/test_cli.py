"""The ``kvfuzz`` command line, run as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

from factories import kvfuzz


def test_run_json_summary_has_the_documented_keys(tmp_path: Path) -> None:
    result = kvfuzz("run", "--examples", "10", "--steps", "20", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert {"examples", "steps", "seconds", "failed", "operations"} <= set(summary)
    assert summary["failed"] is False and summary["examples"] >= 10 and summary["steps"] > 0
    assert summary["operations"]["admit"] > 0


def test_run_on_a_broken_allocator_prints_the_program_and_the_explanation_and_fails(tmp_path: Path) -> None:
    result = kvfuzz("run", "--allocator", "zoo:KeyWithoutNamespace", "--examples", "200", cwd=tmp_path)
    assert result.returncode == 1
    assert "invariant 9 (cache soundness)" in result.stdout
    assert "shrunk program" in result.stdout and "state.admit(" in result.stdout
    assert "expected:" in result.stdout and "found:" in result.stdout
    assert len(list((tmp_path / "corpus").glob("*.json"))) == 1


def test_unknown_allocator_is_a_usage_error(tmp_path: Path) -> None:
    result = kvfuzz("run", "--allocator", "no_such_module:factory", cwd=tmp_path)
    assert result.returncode == 2
    assert "cannot import 'no_such_module'" in result.stderr


def test_own_allocator_by_import_path(tmp_path: Path) -> None:
    result = kvfuzz(
        "run",
        "--allocator",
        "kvfuzz.allocator.paged:synchronous_allocator",
        "--examples",
        "5",
        "--json",
        "--num-blocks",
        "32",
        "--dtype",
        "bfloat16",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["failed"] is False


def test_zoo_prints_a_row_per_variant_and_passes_when_each_is_caught_as_expected(tmp_path: Path) -> None:
    result = kvfuzz("zoo", "--only", "LeakOnCancel", "RollbackKeepsStaleBlock", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| LeakOnCancel | 2 leak on cancel | yes | invariant 4 (free set) |" in result.stdout
    assert "2 of 2 variants caught by the expected invariant" in result.stdout
    assert kvfuzz("zoo", "--only", "NoSuchVariant", cwd=tmp_path).returncode == 2
