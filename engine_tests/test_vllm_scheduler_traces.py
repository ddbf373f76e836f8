"""Scheduler traces end to end (kvfuzz.scheduler.trace, docs/scheduler.md): a seeded bug found by ``kvfuzz run
--scheduler`` is saved to the corpus (the unshrunk example first, at once), ``kvfuzz replay`` reproduces the same
failure, the exported pytest file fails on the bug and passes without it, ``kvfuzz show`` prints it, and pytest
collects the trace file.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there): without vLLM 0.33.0 the import
fails loudly rather than skipping."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.sched.scheduler import Scheduler
from vllm_versions import V1_RUNNER

from kvfuzz.cli import main
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.engines import VLLM
from kvfuzz.scheduler.recorder import FailureRecorder
from kvfuzz.scheduler.replay import ReplayRefused, replay
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.trace import load
from kvfuzz.scheduler.violations import SchedulerViolation

SMALL = SchedulerSetup(num_blocks=8)
RUN = ["run", "--scheduler", "vllm-v1", "--num-blocks", "8", "--examples", "30"]
SEEDED = "from vllm.v1.core.block_pool import BlockPool\nBlockPool.touch = lambda self, blocks: None\n"
"""The seeded bug as a conftest.py: a prefix hit that takes no reference (the accounting check catches it)."""


def seed_hit_without_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BlockPool, "touch", lambda self, blocks: None)


def run_and_load(corpus: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> Path:
    assert main([*RUN, "--corpus", str(corpus), *extra]) == 1
    out = capsys.readouterr().out
    traces = sorted(corpus.glob("*.json"))
    assert len(traces) == 1, (out, traces)
    assert f"trace saved to {traces[0]}" in out and f"kvfuzz replay {traces[0]}" in out
    return traces[0]


def test_a_seeded_bug_is_saved_replayed_exported_shown_and_collected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seed_hit_without_reference(monkeypatch)
    path = run_and_load(tmp_path / "corpus", capsys)
    trace = load(path)
    data = json.loads(path.read_text())
    assert data["format"] == "kvfuzz-scheduler-trace/1" and data["scheduler"] == "vllm-v1"
    assert data["engine"] == {"vllm_version": VLLM.installed(), "model_runner": "V2"}  # the release it ran on
    assert VLLM.installed() in VLLM.tested
    assert data["config"] == {
        "num_blocks": 8,
        "block_size": 4,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 4,
        "prefix_caching": True,
    }
    assert trace.shrunk and trace.failure.check == "accounting" and trace.failure.exception is None
    assert "accounting check failed at step" in trace.failure.message
    assert any(operation["op"] == "add" for operation in data["program"])

    # replay reproduces the same failure, word for word, and exits 1
    assert main(["replay", str(path)]) == 1
    out = capsys.readouterr().out
    assert "REPRODUCED at " in out and "(the recorded message, word for word)" in out, out
    assert trace.failure.message in out

    # show prints the configuration, the program and the failure, and draws the timeline as a page
    page = tmp_path / "timeline.html"
    assert main(["show", str(path), "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert "8 blocks x 4 slots, token budget 16, at most 4 running, prefix caching on" in out
    assert "add(prompt=" in out and f"failure: {trace.failure.message}" in out
    assert f"timeline: {page}" in out and 'id="failing-column"' in page.read_text(encoding="utf-8")

    # the exported test fails on the bug, with the check's violation, and passes without it
    exported = tmp_path / "test_exported.py"
    assert main(["export", str(path), "-o", str(exported)]) == 0
    capsys.readouterr()
    spec = importlib.util.spec_from_file_location("exported_scheduler_trace", exported)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (test,) = [getattr(module, name) for name in dir(module) if name.startswith("test_")]
    with pytest.raises(SchedulerViolation) as caught:
        test()
    assert str(caught.value) == trace.failure.message
    monkeypatch.undo()
    test()

    # without the bug, replay says it no longer reproduces (exit 0)
    assert main(["replay", str(path)]) == 0
    assert "the failure no longer reproduces" in capsys.readouterr().out


def test_pytest_collects_a_scheduler_trace_and_fails_while_it_reproduces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seed_hit_without_reference(monkeypatch)
    path = run_and_load(tmp_path / "corpus", capsys)
    monkeypatch.undo()
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def pytest_on_trace() -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider", "-rs"]
        return subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)

    (tmp_path / "conftest.py").write_text(SEEDED)
    failing = pytest_on_trace()
    assert failing.returncode == 1 and "the recorded failure still reproduces" in failing.stdout, failing.stdout
    (tmp_path / "conftest.py").unlink()
    passing = pytest_on_trace()
    assert passing.returncode == 0 and "1 passed" in passing.stdout, passing.stdout + passing.stderr


def test_the_unshrunk_failure_is_saved_when_found_and_replaced_once_shrunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed_hit_without_reference(monkeypatch)
    recorder = FailureRecorder("vllm-v1", tmp_path)
    on_disk: list[list[Path]] = []

    def witness(session: Session, error: BaseException) -> None:
        recorder(session, error)
        on_disk.append(sorted(tmp_path.glob("*.json")))

    outcome = search(SMALL, examples=30, steps=50, witness=witness)
    assert outcome.check() == "accounting" and len(on_disk) > 1  # found, then shrunk
    (first,) = on_disk[0]  # on disk as soon as the first example failed, before any shrinking
    unshrunk = load(first)
    assert not unshrunk.shrunk and unshrunk.failure.check == "accounting"
    assert replay(unshrunk).reproduced
    saved = recorder.finish(outcome.failure, shrunk=True)
    assert saved is not None and saved.error is None
    assert sorted(tmp_path.glob("*.json")) == [saved.path]
    shrunk = load(saved.path)
    assert shrunk.shrunk and len(shrunk.program) <= len(unshrunk.program)
    assert str(outcome.failure) == shrunk.failure.message


def test_without_shrinking_the_trace_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seed_hit_without_reference(monkeypatch)
    trace = load(run_and_load(tmp_path, capsys, "--no-shrink"))
    assert not trace.shrunk and replay(trace).reproduced


def test_a_crash_of_vllm_s_own_and_the_v1_model_runner_are_recorded_and_replayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trace recorded under the V1 runner's protocol replays under it, whatever the environment selects."""

    def preempt(self: Scheduler, request: Any, *args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"seeded: preempting {request.request_id}")

    monkeypatch.setattr(Scheduler, "_preempt_request", preempt)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    trace = load(run_and_load(tmp_path, capsys, "--examples", "50"))
    if not V1_RUNNER:  # vLLM 0.34.0 removed Model Runner V1: recorded under V2's protocol, and a V1 trace refused
        assert trace.model_runner == "V2"
        with pytest.raises(ReplayRefused, match="recorded with vLLM's V1 model runner, and this vLLM selects V2"):
            replay(attrs.evolve(trace, model_runner="V1"))
        return
    assert trace.model_runner == "V1"
    assert (trace.failure.check, trace.failure.exception) == ("crash", "AssertionError")
    assert trace.failure.message.startswith("AssertionError: seeded: preempting r")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    replayed = replay(trace)
    assert replayed.reproduced and replayed.identical, replayed.describe_failure()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"  # restored after the replay


def test_isolate_keeps_the_program_of_a_run_whose_process_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvfuzz run --scheduler --isolate``: vLLM killing the process running the examples is a finding of the run,
    its program kept from the journal; the run itself reports it and exits 1."""
    import signal

    from kvfuzz.scheduler.trace import PROCESS_DIED

    schedule = Scheduler.schedule

    def killing(self: Scheduler) -> Any:
        if len(self.running) >= 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return schedule(self)

    monkeypatch.setattr(Scheduler, "schedule", killing)
    assert main([*RUN, "--isolate", "--corpus", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"FAILED: crash: {PROCESS_DIED}: the process running the examples was killed by signal 9 (SIGKILL)" in out
    [path] = tmp_path.glob("*.json")
    assert f"trace saved to {path}" in out and "not shrunk" in out
    trace = load(path)
    assert trace.failure.exception == PROCESS_DIED and not trace.shrunk
    assert [type(operation).__name__ for operation in trace.program].count("AddRequest") >= 2, trace.program
    assert not list(tmp_path.glob(".kvfuzz-journal-*")), "the journal is removed"

    assert main([*RUN, "--isolate", "--json", "--corpus", str(tmp_path / "json")]) == 1
    reported = json.loads(capsys.readouterr().out)
    assert (reported["failed"], reported["check"]) == (True, "crash"), reported
    assert load(Path(reported["trace"])).failure.exception == PROCESS_DIED


def test_isolate_reports_a_check_s_failure_as_a_run_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A failure the isolated examples found is shrunk, saved and reported by the child as without ``--isolate``."""
    seed_hit_without_reference(monkeypatch)
    assert main([*RUN, "--isolate", "--corpus", str(tmp_path)]) == 1
    out = capfd.readouterr().out
    [path] = tmp_path.glob("*.json")
    assert "FAILED" in out and f"trace saved to {path}" in out, out
    trace = load(path)
    assert trace.shrunk and trace.failure.check == "accounting"
    assert replay(trace).reproduced
