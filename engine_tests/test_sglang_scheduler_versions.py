"""The version matrix and harness errors on SGLang's scheduler target (docs/scheduler.md, "Versions"), as
engine_tests/test_vllm_scheduler_versions.py and test_vllm_scheduler_harness.py check them on vLLM's:

* an SGLang release kvfuzz is not tested on (the installed one read as a post-release of it) is refused by ``run``
  and ``campaign`` in one line; with ``--untested-engine`` a run warns and its trace records the version;
* against an SGLang whose ``ScheduleBatch`` spells ``extend_lens`` (which kvfuzz's session reads after
  ``prepare_for_extend``) another way, ``run``, ``campaign`` and ``replay`` each report a harness error with its
  traceback and hint, exit status 3, and save no trace.

Runs in each SGLang environment (``scripts/third_party_env.sh sglang@VERSION``; CI runs it in each)."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvfuzz.cli import main
from kvfuzz.scheduler.engines import SGLANG
from kvfuzz.scheduler.sglang.build import sglang

CORPUS = Path(__file__).resolve().parent.parent / "corpus"
INSTALLED = importlib.metadata.version("sglang")
UNTESTED = f"{INSTALLED}.post1"  # a post-release of the installed one: tested by no one
HINT = "kvfuzz: harness error, not a finding: kvfuzz's own code raised AttributeError at kvfuzz/scheduler/sglang/"


@pytest.fixture
def untested(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The installed SGLang reads as :data:`UNTESTED` (everywhere kvfuzz reads a version)."""
    version = importlib.metadata.version

    def reads(distribution_name: str) -> str:
        return UNTESTED if distribution_name == "sglang" else version(distribution_name)

    monkeypatch.setattr(importlib.metadata, "version", reads)
    yield


def _no_traces(directory: Path) -> None:
    assert not directory.exists() or not list(directory.glob("*.json")), list(directory.glob("*.json"))


@pytest.mark.parametrize("command", ["run", "campaign"])
def test_an_untested_sglang_is_refused_in_one_line_before_any_example(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], untested: None, command: str
) -> None:
    assert INSTALLED in SGLANG.tested and UNTESTED not in SGLANG.tested
    monkeypatch.chdir(tmp_path)
    status = main([command, "--scheduler", "sglang", "--corpus", str(tmp_path / "corpus")])
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err.splitlines() == [
        f"kvfuzz: --scheduler sglang: SGLang {UNTESTED} is installed, and kvfuzz is tested on SGLang "
        f"{SGLANG.tested_text()} only; run it anyway with --untested-engine (a failure may then be kvfuzz not "
        "speaking this version)"
    ]
    _no_traces(tmp_path / "corpus")


def _fail_the_first_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's ``prepare_for_decode`` raises: an example fails at its first decode, after a prefill (a finding:
    not kvfuzz's code)."""

    def prepare_for_decode(self: Any) -> None:
        raise RuntimeError("seeded: prepare_for_decode fails")

    monkeypatch.setattr(sglang().ScheduleBatch, "prepare_for_decode", prepare_for_decode)


def test_run_with_untested_engine_warns_and_the_trace_records_the_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], untested: None
) -> None:
    _fail_the_first_decode(monkeypatch)
    corpus = tmp_path / "corpus"
    status = main(["run", "--scheduler", "sglang", "--examples", "20", "--untested-engine", "--corpus", str(corpus)])
    out, err = capsys.readouterr()
    assert status == 1, out + err
    assert err.splitlines()[0] == (
        f"kvfuzz: warning: SGLang {UNTESTED} is not a version kvfuzz is tested on ({SGLANG.tested_text()}); its "
        "findings and harness errors may be kvfuzz not speaking it; its traces record the version"
    )
    assert out.startswith(f"kvfuzz run: --scheduler sglang (SGLang {UNTESTED}'s SchedulePolicy")
    assert "crash: RuntimeError" in out and "harness error, not a finding" not in out + err
    traces = sorted(corpus.glob("*.json"))
    assert traces and all(json.loads(path.read_text())["engine"] == {"sglang_version": UNTESTED} for path in traces)


def _rename_extend_lens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``ScheduleBatch`` holds ``extend_lens`` under another name once ``prepare_for_extend`` has set it."""
    batch_class = sglang().ScheduleBatch
    original = batch_class.prepare_for_extend

    def prepare_for_extend(self: Any) -> None:
        original(self)
        self.__dict__["extend_lengths"] = self.__dict__.pop("extend_lens")

    monkeypatch.delattr(batch_class, "extend_lens")  # the dataclass field's class-level default
    monkeypatch.setattr(batch_class, "prepare_for_extend", prepare_for_extend)


def test_run_reports_a_harness_error_and_saves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _rename_extend_lens(monkeypatch)
    status = main(["run", "--scheduler", "sglang", "--examples", "20", "--corpus", str(tmp_path / "corpus")])
    out, err = capsys.readouterr()
    assert status == 3, out + err
    assert "STOPPED by a harness error" in out and "FAILED" not in out
    assert "Traceback (most recent call last)" in err and "extend_lens" in err
    assert err.rstrip().splitlines()[-1].startswith(HINT)
    assert f"while driving SGLang {INSTALLED};" in err
    _no_traces(tmp_path / "corpus")


@pytest.mark.parametrize(
    "where", [["--no-known"], ["--known", str(CORPUS)]], ids=["a-batch", "replaying-the-known-corpus"]
)
def test_a_campaign_ends_on_a_harness_error_with_no_finding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], where: list[str]
) -> None:
    _rename_extend_lens(monkeypatch)
    corpus = tmp_path / "corpus"
    argv = ["campaign", "--scheduler", "sglang", "--seed", "7", "--max-examples", "50", "--corpus", str(corpus)]
    status = main([*argv, *where])  # seed 7 draws pools that admit requests (3 blocks of 2 slots admit none)
    out, err = capsys.readouterr()
    assert status == 3, out + err
    assert "a harness error, not a finding" in out and "0 new distinct failures" in out
    assert "extend_lens" in out and HINT in out
    _no_traces(corpus)


def test_replay_reports_a_harness_error_not_the_trace_s_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.MonkeyPatch.context() as seeded:  # a trace whose program prefills, then fails at a decode
        _fail_the_first_decode(seeded)
        argv = ["run", "--scheduler", "sglang", "--examples", "20", "--corpus", str(tmp_path / "corpus")]
        assert main(argv) == 1
    [trace] = sorted((tmp_path / "corpus").glob("*.json"))
    capsys.readouterr()
    assert main(["replay", str(trace)]) == 0  # SGLang as installed: the trace passes
    _rename_extend_lens(monkeypatch)
    status = main(["replay", str(trace)])
    out, err = capsys.readouterr()
    assert status == 3, out + err
    assert "REPRODUCED" not in out and "FAILED DIFFERENTLY" not in out
    assert err.rstrip().splitlines()[-1].startswith(HINT)
