"""A vLLM release kvfuzz is not tested on (docs/scheduler.md, "Versions"): the installed vLLM's version read as a
post-release of it, which no one has tested. ``kvfuzz run`` and ``kvfuzz campaign --scheduler vllm-v1`` refuse
it in one line before any example, naming the installed and the tested versions and ``--untested-engine``; with that
option each runs it after a warning line, speaking the installed release's own protocol (the newest tested one not
newer), and the trace of what it finds records the version it ran on. The pytest plugin's ``--kvfuzz-scheduler``
likewise, with ``--kvfuzz-untested-engine``.

Runs in each vLLM environment (``scripts/third_party_env.sh vllm@VERSION``; CI runs it in each)."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from kvfuzz.cli import main
from kvfuzz.scheduler import vllm_release
from kvfuzz.scheduler.engines import VLLM

pytest_plugins = ["pytester"]

INSTALLED = importlib.metadata.version("vllm")
UNTESTED = f"{INSTALLED}.post1"  # a post-release of the installed one: tested by no one
WARNING = (
    f"kvfuzz: warning: vLLM {UNTESTED} is not a version kvfuzz is tested on ({VLLM.tested_text()}); its findings "
    "and harness errors may be kvfuzz not speaking it; its traces record the version"
)


@pytest.fixture(autouse=True)
def untested(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The installed vLLM reads as :data:`UNTESTED` (everywhere kvfuzz reads a version)."""
    version = importlib.metadata.version

    def reads(distribution_name: str) -> str:
        return UNTESTED if distribution_name == "vllm" else version(distribution_name)

    monkeypatch.setattr(importlib.metadata, "version", reads)
    vllm_release.vllm_release.cache_clear()
    yield
    vllm_release.vllm_release.cache_clear()


def _crash_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``update_from_output`` raises: every example fails at its first step (a finding: not kvfuzz's code)."""

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        raise RuntimeError("seeded: update_from_output fails")

    monkeypatch.setattr(Scheduler, "update_from_output", update_from_output)


@pytest.mark.parametrize("command", ["run", "campaign"])
def test_an_untested_vllm_is_refused_in_one_line_before_any_example(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    assert INSTALLED in VLLM.tested and UNTESTED not in VLLM.tested
    monkeypatch.chdir(tmp_path)
    status = main([command, "--scheduler", "vllm-v1", "--corpus", str(tmp_path / "corpus")])
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err.splitlines() == [
        f"kvfuzz: --scheduler vllm-v1: vLLM {UNTESTED} is installed, and kvfuzz is tested on vLLM "
        f"{VLLM.tested_text()} only; run it anyway with --untested-engine (a failure may then be kvfuzz not speaking "
        "this version)"
    ]
    assert not (tmp_path / "corpus").exists()


def _recorded(corpus: Path) -> dict[str, Any]:
    traces = sorted(corpus.glob("*.json"))
    assert traces, "no trace saved"
    engines = [json.loads(path.read_text())["engine"] for path in traces]
    assert all(engine == engines[0] for engine in engines), engines
    return engines[0]


def test_run_with_untested_engine_warns_speaks_the_nearest_tested_protocol_and_records_the_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _crash_every_step(monkeypatch)
    corpus = tmp_path / "corpus"
    argv = ["run", "--scheduler", "vllm-v1", "--examples", "10", "--untested-engine", "--corpus", str(corpus)]
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 1, out + err
    assert err.splitlines()[0] == WARNING
    assert out.startswith(
        f"kvfuzz run: --scheduler vllm-v1 (vLLM's v1 Scheduler with its KVCacheManager, vLLM {UNTESTED};"
    )
    assert "crash: RuntimeError" in out and "harness error, not a finding" not in out + err
    assert vllm_release.vllm_release() is vllm_release.TESTED[INSTALLED]
    assert _recorded(corpus) == {"vllm_version": UNTESTED, "model_runner": "V2"}


def test_a_campaign_with_untested_engine_warns_and_records_the_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _crash_every_step(monkeypatch)
    corpus = tmp_path / "corpus"
    argv = ["campaign", "--scheduler", "vllm-v1", "--untested-engine", "--no-known", "--seed", "7"]
    status = main([*argv, "--max-examples", "20", "--batch-examples", "10", "--corpus", str(corpus)])
    out, err = capsys.readouterr()
    assert status == 1, out + err
    assert err.splitlines()[0] == WARNING
    assert "RuntimeError" in out and "harness error, not a finding" not in out + err
    assert _recorded(corpus)["vllm_version"] == UNTESTED


def test_the_pytest_plugin_refuses_it_in_one_line_and_searches_it_after_a_warning(pytester: pytest.Pytester) -> None:
    refused = pytester.runpytest("--kvfuzz-scheduler", "vllm-v1", "-p", "no:cacheprovider")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    assert [line for line in refused.errlines if line] == [
        f"ERROR: --kvfuzz-scheduler vllm-v1: vLLM {UNTESTED} is installed, and kvfuzz is tested on vLLM "
        f"{VLLM.tested_text()} only; run it anyway with --kvfuzz-untested-engine (a failure may then be kvfuzz not "
        "speaking this version)"
    ]
    bounds = ("--kvfuzz-examples", "5", "--kvfuzz-corpus", str(pytester.path / "corpus"), "-p", "no:cacheprovider")
    searched = pytester.runpytest("--kvfuzz-scheduler", "vllm-v1", "--kvfuzz-untested-engine", *bounds)
    assert searched.ret == pytest.ExitCode.OK, searched.outlines
    searched.stdout.fnmatch_lines([WARNING, "*1 passed*"])
