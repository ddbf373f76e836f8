"""kvfuzz's own failures are never findings (kvfuzz.scheduler.harness): against a vLLM whose ``SchedulerOutput``
spells an attribute kvfuzz's worker reads another way (``SchedulerOutput.scheduled_new_reqs`` renamed, as a new
release might), ``kvfuzz run --scheduler``, ``kvfuzz campaign --scheduler`` (in its process, and with ``--isolate`` in
a child) and ``kvfuzz replay`` each report a harness error, with its traceback and one hint line, exit status 3, and
save no trace (a campaign ends on it, in a batch or while it replays the known corpus); and an exception vLLM raises
itself stays a finding.

Runs in each vLLM environment (``scripts/third_party_env.sh vllm@VERSION``; CI runs it in each)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from kvfuzz.cli import main

CORPUS = Path(__file__).resolve().parent.parent / "corpus"
PADDING_HANG = CORPUS / "vllm-v1-scheduler-speculative-padding-hang-6123748f32e9.json"
HINT = "kvfuzz: harness error, not a finding: kvfuzz's own code raised AttributeError at kvfuzz/scheduler/"


def _rename_new_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every SchedulerOutput carries ``scheduled_new_reqs`` under another name."""
    schedule = Scheduler.schedule

    def renamed(self: Any) -> Any:
        output = schedule(self)
        output.__dict__["scheduled_new_requests"] = output.__dict__.pop("scheduled_new_reqs")
        return output

    monkeypatch.setattr(Scheduler, "schedule", renamed)


def _no_traces(directory: Path) -> None:
    assert not directory.exists() or not list(directory.glob("*.json")), list(directory.glob("*.json"))


def test_run_reports_a_harness_error_and_saves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _rename_new_requests(monkeypatch)
    status = main(["run", "--scheduler", "vllm-v1", "--examples", "20", "--corpus", str(tmp_path / "corpus")])
    out, err = capsys.readouterr()
    assert status == 3, out + err
    assert "STOPPED by a harness error" in out and "FAILED" not in out
    assert "Traceback (most recent call last)" in err and "scheduled_new_reqs" in err
    assert err.rstrip().splitlines()[-1].startswith(HINT)
    _no_traces(tmp_path / "corpus")


@pytest.mark.parametrize(
    "where",
    [["--no-known"], ["--no-known", "--isolate"], ["--known", str(CORPUS)]],
    ids=["in-process", "isolated", "replaying-the-known-corpus"],
)
def test_a_campaign_ends_on_a_harness_error_with_no_finding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], where: list[str]
) -> None:
    _rename_new_requests(monkeypatch)
    corpus = tmp_path / "corpus"
    argv = ["campaign", "--scheduler", "vllm-v1", "--seed", "7", "--max-examples", "50", "--corpus", str(corpus)]
    status = main([*argv, *where])
    out, err = capsys.readouterr()
    assert status == 3, out + err
    assert "a harness error, not a finding" in out and "0 new distinct failures" in out
    assert "scheduled_new_reqs" in out and HINT in out
    _no_traces(corpus)


def test_replay_reports_a_harness_error_not_the_trace_s_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / PADDING_HANG.name
    shutil.copyfile(PADDING_HANG, trace)
    _rename_new_requests(monkeypatch)
    status = main(["replay", str(trace)])
    out, err = capsys.readouterr()
    assert status == 3, out + err
    assert "REPRODUCED" not in out and "FAILED DIFFERENTLY" not in out
    assert err.rstrip().splitlines()[-1].startswith(HINT)


def test_an_exception_vllm_raises_itself_is_still_a_finding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The other side of the line: an AttributeError raised inside vLLM's own code is vLLM's crash."""
    update = Scheduler.update_from_output

    def broken(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        if scheduler_output.scheduled_cached_reqs.req_ids:
            return update(self, scheduler_output, None)  # vLLM's own code then fails on None
        return update(self, scheduler_output, model_runner_output)

    monkeypatch.setattr(Scheduler, "update_from_output", broken)
    status = main(["run", "--scheduler", "vllm-v1", "--examples", "20", "--corpus", str(tmp_path / "corpus")])
    out, err = capsys.readouterr()
    assert status == 1, out + err
    assert "crash: AttributeError" in out and "harness error" not in out + err
    assert list((tmp_path / "corpus").glob("*.json"))


def test_a_failure_that_does_not_replay_is_reported_as_met_never_as_hypothesis_s_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM fails once, in the fifth schedule() of the process, and never again: Hypothesis's replay of the failing
    example passes and it raises its own Flaky error. The search reports the failure the machine met (vLLM's
    exception, with that example's program), never a crash of Hypothesis's."""
    from kvfuzz.scheduler.config import SchedulerSetup
    from kvfuzz.scheduler.search import search

    schedule = Scheduler.schedule
    calls = [0]

    def once(self: Any) -> Any:
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("a scheduler that fails once")
        return schedule(self)

    monkeypatch.setattr(Scheduler, "schedule", once)
    outcome = search(SchedulerSetup(num_blocks=8), examples=20, steps=20)
    assert outcome.harness is None, outcome.harness
    assert isinstance(outcome.failure, RuntimeError) and "fails once" in str(outcome.failure), outcome.failure
    assert "hypothesis" not in outcome.explanation().lower(), outcome.explanation()
    assert "state.step()" in outcome.program and "not shrunk further" in outcome.program, outcome.program
