"""The ``kvfuzz`` command line, run as a user runs it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from factories import kvfuzz


@pytest.mark.slow
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
    assert len(list((tmp_path / ".kvfuzz" / "corpus").glob("*.json"))) == 1


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


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's parser, by name."""
    from kvfuzz.commands import account, campaign, export, replay, replay_workload, run, serving, show, zoo

    subparsers = argparse.ArgumentParser().add_subparsers()
    for command in (run, campaign, replay, show, export, zoo, account, replay_workload, serving):
        command.register(subparsers)
    return dict(subparsers.choices)


@pytest.mark.parametrize("flag", ["--call-timeout", "--corpus", "--database"])
def test_a_flag_has_one_default_in_every_command(flag: str) -> None:
    defaults = {
        name: action.default
        for name, parser in _commands().items()
        for action in parser._actions
        if flag in action.option_strings
    }
    assert len(defaults) >= 2, f"{flag} is one command's flag: {sorted(defaults)}"
    assert len(set(defaults.values())) == 1, defaults


def test_the_walkthrough_saves_its_trace_where_pytest_does_not_collect(tmp_path: Path) -> None:
    """The README's walk-through, then its ``pytest``, in a checkout: the trace of the zoo's slip must not land in the
    ``corpus`` that pytest collects (``testpaths``), where it would be a regression test that fails."""
    result = kvfuzz("run", "--allocator", "zoo:NoCopyOnWrite", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert not (tmp_path / "corpus").exists()
    (saved,) = (tmp_path / ".kvfuzz" / "corpus").glob("*.json")
    assert f"trace saved to .kvfuzz/corpus/{saved.name}" in result.stdout


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:1/0", pytest.param("http://example.invalid/db", marks=pytest.mark.slow)]
)
def test_run_takes_a_database_url_as_campaign_does_or_refuses_it_in_one_line(tmp_path: Path, url: str) -> None:
    """``--database redis://...`` is Redis in ``kvfuzz campaign``; ``kvfuzz run`` took it for a directory named
    ``redis:``. Here no Redis answers (or its client is not installed), and any other URL is not a database."""
    result = kvfuzz("run", "--database", url, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(f"kvfuzz: --database {url}") and result.stderr.count("\n") == 1, result.stderr
    assert result.stdout == "" and list(tmp_path.iterdir()) == []


def test_a_failure_in_the_teardown_is_blamed_on_the_teardown(tmp_path: Path) -> None:
    """The teardown frees every sequence still alive: a refcount it then finds wrong was reported as ``violated by
    free('s0')``, a call the printed program does not contain."""
    from test_timeline import teardown_refcount_trace

    from kvfuzz.saved.trace import save

    path, _ = save(teardown_refcount_trace(), tmp_path)
    result = kvfuzz("replay", str(path), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "state.free(" not in result.stdout
    assert "invariant 3 (refcounts) violated by the teardown's free('s0') (scheduling step 1):" in result.stdout


def test_python_dash_m_kvfuzz_is_the_kvfuzz_command(tmp_path: Path) -> None:
    """``python -m kvfuzz`` answers as ``kvfuzz`` does: its help, and a usage error in one line with status 2."""
    command = [sys.executable, "-m", "kvfuzz"]
    helped = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert helped.returncode == 0 and "replay-workload" in helped.stdout, helped.stderr
    refused = subprocess.run([*command, "run", "--examples", "0"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr
    assert len(refused.stderr.splitlines()) == 1 and "--examples" in refused.stderr
