"""A process-killing crash reported by the run it killed: ``kvfuzz run --isolate`` (and the plugin's
``--kvfuzz-isolate``) runs the allocator in a child process and reports its death with its program, saved as a trace;
a failure that does not kill is reported as without isolation; and without isolation, the dying run's last words name
its journal and the command that recovers it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfuzz.saved.corpus import PROCESS_DIED
from kvfuzz.saved.trace import load

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _kvfuzz(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvfuzz.cli", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)


def test_isolate_reports_a_segfault_with_its_program_saves_its_trace_and_exits_1(tmp_path: Path) -> None:
    done = _kvfuzz("run", "--isolate", "--allocator", "tests.hostile:segfaults_on_rollback", "--corpus", str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert f"FAILED: {PROCESS_DIED}: the isolated run (pid " in done.stdout
    assert "was killed by signal 11 (SIGSEGV)" in done.stdout
    (trace_path,) = tmp_path.glob("*.json")  # saved by this run, not left to the next one
    assert not list(tmp_path.glob(".kvfuzz-journal-*"))
    trace = load(trace_path)
    assert trace.failure["title"] == PROCESS_DIED and trace.program[-1].rule == "rollback"
    # the hostile allocator is no registered one: the printed replay trusts it, as its user named it (issue 45, item 9)
    replay = f"replay it with: kvfuzz replay --trust-allocator {trace_path}"
    assert f"trace saved to {trace_path}" in lines and replay in lines
    program = lines[lines.index("state = KVCacheMachine_segfaults_on_rollback()") :]
    assert program[len(trace.program)].startswith("state.rollback(")  # the program, printed, up to the fatal call
    assert "Segmentation fault" in done.stderr  # where it died: the child's faulthandler


@pytest.mark.slow
def test_isolate_reports_an_ordinary_failure_as_a_run_in_one_process_does(tmp_path: Path) -> None:
    """The child's exception class cannot cross into the parent; its trace carries the invariant all the same."""
    args = ("run", "--json", "--allocator", "zoo:NoCopyOnWrite", "--examples", "200", "--corpus")
    isolated = _kvfuzz(*args, str(tmp_path / "isolated"), "--isolate")
    alone = _kvfuzz(*args, str(tmp_path / "alone"))
    assert isolated.returncode == alone.returncode == 1, isolated.stderr + alone.stderr
    found, expected = json.loads(isolated.stdout), json.loads(alone.stdout)
    for field in ("failed", "invariant", "program", "explanation", "examples", "reproduced", "replays"):
        assert found[field] == expected[field], field
    assert Path(found["trace"]).name == Path(expected["trace"]).name
    assert load(Path(found["trace"])).failure == load(Path(expected["trace"])).failure


def test_without_isolation_the_dying_runs_last_words_name_its_journal_and_the_recovery(tmp_path: Path) -> None:
    died = _kvfuzz("run", "--allocator", "tests.hostile:segfaults_on_rollback", "--corpus", str(tmp_path))
    assert died.returncode == -signal.SIGSEGV, died.stdout + died.stderr
    (journal,) = tmp_path.glob(".kvfuzz-journal-*.jsonl")
    last = died.stderr.rstrip().splitlines()[-1]
    assert last.startswith("kvfuzz: this run (pid ") and f"in its journal {journal}:" in last, died.stderr
    assert f"the next `kvfuzz run --corpus {tmp_path}` turns it into a trace" in last


@pytest.mark.slow
def test_the_plugins_isolate_option_fails_the_item_with_the_death_and_its_trace(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path),
         "--kvfuzz-allocator=tests.hostile:segfaults_on_rollback", "--kvfuzz-isolate", f"--kvfuzz-corpus={corpus}",
         str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed" in done.stdout and "was killed by signal 11 (SIGSEGV)" in done.stdout
    (trace_path,) = corpus.glob("*.json")
    assert f"trace saved to {trace_path}" in done.stdout
    assert load(trace_path).program[-1].rule == "rollback"


@pytest.mark.slow
def test_ctrl_c_reaches_the_isolated_child_through_the_run_which_stops_with_what_it_found(tmp_path: Path) -> None:
    """The child has a process group of its own, as a terminal's Ctrl-C does not reach it: the run forwards it."""
    command = [
        sys.executable,
        "-m",
        "kvfuzz.cli",
        "run",
        "--isolate",
        "--examples",
        "100000",
        "--corpus",
        str(tmp_path),
    ]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    assert process.stderr is not None
    for line in process.stderr:
        if "random programs: example" in line:
            break
    process.send_signal(signal.SIGINT)  # to the run alone
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stdout + stderr
    assert "interrupted after" in stdout and "no failure found" in stdout and "Traceback" not in stderr
    assert not list(tmp_path.glob("*.json")) and not list(tmp_path.glob(".kvfuzz-journal-*"))


@pytest.mark.parametrize(
    ("factory", "isolate"),
    [
        ("exits_cleanly_on_rollback", False),
        ("exits_cleanly_on_rollback", True),
        ("exits_through_its_own_reference_on_rollback", False),
    ],
    ids=["alone", "isolated", "its own reference to os._exit, alone"],
)
def test_an_allocator_that_calls_os_exit_0_is_a_crash_finding_with_its_program_saved(
    tmp_path: Path, factory: str, isolate: bool
) -> None:
    """Before: exit status 0 without --isolate (a pass to CI, a last-words line on standard error), and 3 ("kvfuzz
    itself failed") with it; and exit status 0 still for a module that took ``os._exit`` at import (``from os
    import _exit``), before the run replaced it. Now ``os._exit`` raises in the run's process from before the
    allocator's module is imported: the crash is found, shrunk and saved."""
    args = ["run", "--allocator", f"tests.hostile:{factory}", "--corpus", str(tmp_path), "--json"]
    done = _kvfuzz(*args, *(["--isolate"] if isolate else []))
    assert done.returncode == 1, done.stdout + done.stderr
    found = json.loads(done.stdout)
    assert found["failed"] and "os._exit(0) called: the allocator ended the process" in found["explanation"]
    trace = load(Path(found["trace"]))
    assert trace.program[-1].rule == "rollback"


def test_an_allocator_that_exits_in_c_under_isolate_is_its_death_with_its_program(tmp_path: Path) -> None:
    """The C library's ``exit(0)`` is beyond Python: the isolated child ends with status 0 in the middle of an
    example, its journal left behind. Before: exit status 3, "kvfuzz itself failed"; now the allocator's death, exit
    status 1, its program saved from the journal."""
    args = ["run", "--isolate", "--allocator", "tests.hostile:exits_in_c_on_rollback", "--corpus", str(tmp_path)]
    done = _kvfuzz(*args)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "exited with status 0 in the middle of an example" in done.stdout
    (trace_path,) = tmp_path.glob("*.json")
    assert load(trace_path).program[-1].rule == "rollback"


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _command_line(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.2)
    return False


def _start_hung_isolated_run(tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    """``kvfuzz run --isolate`` against an allocator that ignores SIGTERM and SIGINT and sleeps in admit: the run
    and its child's pid, once the child is running."""
    command = [sys.executable, "-m", "kvfuzz.cli", "run", "--isolate", "--allocator"]
    command += ["tests.hostile:ignores_signals_and_sleeps", "--corpus", str(tmp_path), "--call-timeout", "300"]
    run = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        children = [  # the isolated child, not multiprocessing's resource tracker beside it
            pid for pid in _children(run.pid) if b"spawn_main" in _command_line(pid)
        ]
        journals = list(tmp_path.glob(".kvfuzz-journal-*"))
        if children and journals:
            time.sleep(3)  # the child is in its examples: torch imported, the allocator built
            return run, children[0]
        time.sleep(0.2)
    run.kill()
    pytest.fail("the isolated child never started its examples")


@pytest.mark.slow
def test_isolate_kills_a_child_that_ignores_the_stop_and_exits(tmp_path: Path) -> None:
    """Before: the run went on for minutes through SIGTERM and SIGINT. Now the run forwards the stop, and kills the
    child's process group STOP_GRACE seconds later: the run ends, its child with it."""
    run, child = _start_hung_isolated_run(tmp_path)
    try:
        started = time.monotonic()
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        run.kill()
    assert took < 40, took
    assert _wait_gone(child, 10), "the child outlived the run"
    # the user's stop, never the allocator's death: no finding, no trace (it was reported as killed by SIGKILL)
    assert run.returncode == 130 and "interrupted before the isolated run had a result" in out, out
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.slow
def test_isolate_s_child_never_outlives_a_run_killed_with_sigkill(tmp_path: Path) -> None:
    """Before: after a SIGKILL of the run, its child lived one to two minutes more. Now it ends within its orphan
    grace and the kernel's hard stop (kvfuzz.lifeline), whatever it ignores."""
    run, child = _start_hung_isolated_run(tmp_path)
    run.kill()
    run.wait(timeout=30)
    assert _wait_gone(child, 30), "the orphaned child lived on"
