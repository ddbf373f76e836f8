"""The isolation stage every target runs on (kvfuzz/isolation.py), driven directly with forked bodies: a result comes
back, a death is told by its signal or status, kvfuzz's own failure in the child is raised in the parent (never a
death), a child whose heartbeat stops moving is killed as hung, and a stop the caller received is forwarded (a child
that ignores it is killed a grace later and counted as stopped). The targets' own uses are tests/test_isolation.py
(an allocator's run) and tests/test_scheduler_campaign.py, engine_tests/test_sglang_scheduler_safeguards.py (a
scheduler's batches)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kvfuzz import isolation
from kvfuzz.isolation import Ended, Orphaned, Returned, Stopped, run_in_child
from kvfuzz.scheduler.harness import HarnessError

ORPHAN = Orphaned(signal.SIGKILL)


def test_what_the_body_returns_comes_back() -> None:
    assert run_in_child(lambda: {"answer": 42}, "fork", ORPHAN) == Returned({"answer": 42})


def test_a_child_killed_by_a_signal_or_exiting_is_told_apart() -> None:
    killed = run_in_child(lambda: os.kill(os.getpid(), signal.SIGSEGV), "fork", ORPHAN)
    assert isinstance(killed, Ended) and killed.by_signal and killed.how == "was killed by signal 11 (SIGSEGV)"
    assert killed.told() == killed.how
    exited = run_in_child(lambda: os._exit(3), "fork", ORPHAN)
    assert isinstance(exited, Ended) and not exited.by_signal and exited.code == 3
    assert exited.told() == "exited with status 3 without a result"


def _harness_fails() -> None:
    raise HarnessError("Traceback: kvfuzz's own code failed in the child", "a bug in kvfuzz")


def test_kvfuzz_s_own_failure_in_the_child_is_raised_never_a_death() -> None:
    with pytest.raises(HarnessError, match="own code failed"):
        run_in_child(_harness_fails, "fork", ORPHAN)


def test_a_child_whose_heartbeat_stops_is_killed_as_hung(tmp_path: Path) -> None:
    heartbeat = tmp_path / "journal"

    def beats_then_hangs() -> None:
        for _ in range(3):
            heartbeat.write_text("alive")
            time.sleep(0.3)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        time.sleep(60)  # past any interrupt

    started = time.monotonic()
    ended = run_in_child(beats_then_hangs, "fork", ORPHAN, heartbeat=heartbeat, patience=1.0)
    assert isinstance(ended, Ended) and ended.by_signal and ended.how.startswith("hung: no operation for 1 s"), ended
    assert 1.4 < time.monotonic() - started < 10  # it beat for 0.6 s first: its heartbeat kept it alive


def test_a_stop_is_forwarded_and_a_child_that_ignores_it_is_killed_a_grace_later(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(isolation, "STOP_GRACE", 1.0)
    inside = tmp_path / "in its body"  # the child says it is in its body, however long its start took

    def stops_on_sigterm() -> str:
        try:
            inside.touch()
            time.sleep(30)
        except KeyboardInterrupt:
            return "stopped with what it found"
        return "slept"

    def ignores() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        inside.touch()
        time.sleep(30)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    stops: list[int] = []
    stopped_at: list[float] = []

    def caller_interrupted() -> None:  # the caller's deferred interrupts receive a SIGTERM once the child is in
        if not stops and inside.exists():
            stops.append(signal.SIGTERM)
            stopped_at.append(time.monotonic())

    signal.signal(signal.SIGTERM, on_term)  # the fork inherits it; restored below
    try:
        ended = run_in_child(stops_on_sigterm, "fork", ORPHAN, stops=stops, tick=caller_interrupted)
        assert ended == Returned("stopped with what it found")

        inside.unlink()
        stops.clear()
        stopped_at.clear()
        ended = run_in_child(ignores, "fork", ORPHAN, stops=stops, tick=caller_interrupted)
        assert isinstance(ended, Stopped) and ended.signal == signal.SIGTERM, ended
        assert 0.9 < time.monotonic() - stopped_at[0] < 10  # killed a grace (1 s) after the stop it ignored
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
