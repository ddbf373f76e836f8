"""A campaign and its processes: a terminating signal ends it like Ctrl-C (the table, what it was shrinking saved,
exit 128 + the signal), its workers never outlive it however it dies, and a second campaign on the same corpus is
refused while the first runs. The signal tests run a real ``kvfuzz campaign`` process for a few seconds each."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Optional

import pytest

from kvfuzz.campaign.lock import LOCK_FILE, CorpusInUse, CorpusLock
from kvfuzz.campaign.supervisor import STATE_DIRECTORY
from kvfuzz.cli import main
from kvfuzz.saved.trace import load

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _start(corpus: Path, *args: str, slow: str = "0.002") -> subprocess.Popen[str]:
    (corpus.parent / "no-known").mkdir(exist_ok=True)
    command = [sys.executable, "-m", "kvfuzz.cli", "campaign", "--json", "--corpus", str(corpus)]
    command += ["--known", str(corpus.parent / "no-known"), *args]
    return subprocess.Popen(
        command,
        cwd=corpus.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**ENV, "KVFUZZ_TEST_SLOW": slow},
    )


def _wait_for(stream: Optional[IO[str]], text: str, seconds: float = 120) -> str:
    """Read ``stream`` up to a line holding ``text``; everything read."""
    assert stream is not None
    seen = []
    deadline = time.monotonic() + seconds
    for line in stream:
        seen.append(line)
        if text in line:
            return "".join(seen)
        assert time.monotonic() < deadline, "".join(seen)
    pytest.fail(f"the stream ended before {text!r}:\n{''.join(seen)}")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        return [int(child) for child in children.read().split()]


def _alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads worker pids from /proc")


@pytest.mark.slow
def test_sigterm_ends_the_campaign_like_ctrl_c_and_saves_the_failure_being_shrunk(tmp_path: Path) -> None:
    # Each free sleeps 0.2 s: the leak is found at the first free, and shrinking it takes many seconds.
    campaign = _start(
        tmp_path / "corpus",
        *("--allocator", "tests.hostile:slow_free_leak", "--workers", "1", "--duration", "300", "--seed", "0"),
        slow="0.2",
    )
    workers: list[int] = []
    try:
        _wait_for(campaign.stderr, "new failure:")
        workers = _children(campaign.pid)
        assert workers
        campaign.send_signal(signal.SIGTERM)
        stdout, stderr = campaign.communicate(timeout=120)
        assert campaign.returncode == 128 + signal.SIGTERM, stderr
        assert not _wait_gone(workers, 10), "a worker outlived its campaign"
    finally:
        campaign.kill()
        _kill_all(workers)
    result = json.loads(stdout)
    assert result["ended_by"] == "interrupted"
    (failure,) = result["failures"]
    assert failure["trace"] is not None, failure
    assert "the campaign ended" in failure["note"]  # shrunk only as far as it got, and it says so
    trace = load(tmp_path / failure["trace"])
    assert len(trace.program) == failure["shrunk_length"]
    assert "SIGTERM: stopping" in stderr and "Traceback" not in stderr
    assert not list((tmp_path / "corpus").glob(".kvfuzz-journal-*"))


@pytest.mark.slow
def test_sighup_ends_a_clean_campaign_with_its_table_and_status_129(tmp_path: Path) -> None:
    campaign = _start(tmp_path / "corpus", "--workers", "2", "--duration", "300", "--seed", "1")
    workers: list[int] = []
    try:
        _wait_for(campaign.stderr, "steps/s")
        workers = _children(campaign.pid)
        campaign.send_signal(signal.SIGHUP)
        stdout, stderr = campaign.communicate(timeout=60)
        assert campaign.returncode == 128 + signal.SIGHUP, stderr
        assert not _wait_gone(workers, 10), "a worker outlived its campaign"
    finally:
        campaign.kill()
        _kill_all(workers)
    result = json.loads(stdout)
    assert result["ended_by"] == "interrupted" and result["failures"] == [] and result["examples"] > 0


pytest_plugins = ["pytester"]

_HOLD_THE_LOCK = """
import fcntl, os, sys, time
descriptor = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(descriptor, fcntl.LOCK_EX)
os.write(descriptor, f"{os.getpid()}\\n".encode())
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_campaign_on_a_corpus_in_use_is_refused_and_a_dead_ones_lock_taken_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "corpus"
    lock = corpus / STATE_DIRECTORY / LOCK_FILE
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_THE_LOCK, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        _wait_for(holder.stdout, "held", seconds=60)
        status = main(["campaign", "--corpus", str(corpus), "--known", str(tmp_path), "--max-examples", "5"])
        captured = capsys.readouterr()
        assert status == 2 and captured.out == ""
        assert captured.err.splitlines() == [
            f"kvfuzz: --corpus {corpus}: another campaign (pid {holder.pid}) is running on it; wait for it to end, "
            "or give this one another --corpus"
        ]
    finally:
        holder.kill()
        holder.wait()
    assert lock.read_text().strip() == str(holder.pid)  # left behind by a campaign that is gone
    taken = CorpusLock(corpus / STATE_DIRECTORY, corpus)
    taken.acquire()
    try:
        assert lock.read_text().strip() == str(os.getpid())
        with pytest.raises(CorpusInUse):  # held: even this process's second campaign is refused
            CorpusLock(corpus / STATE_DIRECTORY, corpus).acquire()
    finally:
        taken.release()
    CorpusLock(corpus / STATE_DIRECTORY, corpus).acquire()  # released: free again


@pytest.mark.slow
def test_the_nightly_profile_on_a_corpus_in_use_fails_its_item_with_one_line(pytester: pytest.Pytester) -> None:
    """The plugin's campaign meets the same lock: its item fails with the refusal, not with a traceback."""
    lock = pytester.path / "corpus" / STATE_DIRECTORY / LOCK_FILE
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_THE_LOCK, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        _wait_for(holder.stdout, "held", seconds=60)
        result = pytester.runpytest_subprocess(
            "--kvfuzz-allocator=zoo:NoCopyOnWrite",
            "--kvfuzz-profile=nightly",
            "--kvfuzz-duration=5",
            "-p",
            "no:cacheprovider",
        )
    finally:
        holder.kill()
        holder.wait()
    result.assert_outcomes(failed=1)
    output = result.stdout.str()
    assert f"another campaign (pid {holder.pid}) is running on it" in output, output
    assert "Traceback" not in output and "CorpusInUse" not in output, output


@pytest.mark.slow
def test_workers_end_when_their_campaign_is_killed(tmp_path: Path) -> None:
    """SIGKILL leaves the campaign no chance to stop its workers: each notices it is gone, stops, and removes its
    journal (its death is not the allocator's)."""
    corpus = tmp_path / "corpus"
    campaign = _start(corpus, "--workers", "2", "--duration", "300", "--seed", "2")
    workers: list[int] = []
    try:
        _wait_for(campaign.stderr, "steps/s")
        workers = _children(campaign.pid)
        assert len(workers) >= 2
        campaign.kill()
        campaign.wait(timeout=10)
        assert not _wait_gone(workers, 30), "workers outlived their campaign"
    finally:
        campaign.kill()
        _kill_all(workers)
    assert not list(corpus.glob(".kvfuzz-journal-*"))
    assert not list(corpus.glob("*.json"))


@pytest.mark.parametrize("planted", ["symbolic link", "hard link", "linked directory"])
def test_a_lock_planted_as_a_link_is_refused_in_one_line_and_its_target_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], planted: str
) -> None:
    """Before: a ``lock`` symbolic link in the corpus's campaign state (git carries them) had its target truncated
    and overwritten with the campaign's pid."""
    corpus = tmp_path / "corpus"
    lock = corpus / STATE_DIRECTORY / LOCK_FILE
    lock.parent.mkdir(parents=True)
    victim = tmp_path / "precious\x1b[2J.txt"  # the link's target is printed: escaped, never acted on
    victim.write_text("the only copy\n")
    if planted == "symbolic link":
        lock.symlink_to(victim)
    elif planted == "hard link":
        os.link(victim, lock)
    else:  # the campaign state directory itself a link, to a directory holding a file named like the lock
        lock.parent.rmdir()
        victim = tmp_path / "elsewhere" / LOCK_FILE
        victim.parent.mkdir()
        victim.write_text("the only copy\n")
        lock.parent.symlink_to(victim.parent)
    status = main(["campaign", "--corpus", str(corpus), "--known", str(tmp_path), "--max-examples", "5"])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    lines = captured.err.splitlines()
    named = f"state directory {lock.parent}" if planted == "linked directory" else f"lock {lock}"
    assert len(lines) == 1 and lines[0].startswith(f"kvfuzz: --corpus {corpus}: its campaign {named} is a ")
    assert ("a hard link" if planted == "hard link" else "a symbolic link (to ") in lines[0]
    assert "\x1b" not in lines[0] and (planted != "symbolic link" or "precious\\x1b[2J.txt" in lines[0])
    assert "which kvfuzz will not write through; remove it" in lines[0]
    assert victim.read_text() == "the only copy\n"
    if planted == "linked directory":
        lock.parent.unlink()  # removed, as the message says: the campaign makes its own
    else:
        lock.unlink()
    taken = CorpusLock(corpus / STATE_DIRECTORY, corpus)
    taken.acquire()
    taken.release()
    assert lock.read_text().strip() == str(os.getpid()) and not lock.is_symlink()
