"""Shrinking a vLLM finding by deleting operations (kvfuzz/scheduler/shrinking.py), as a campaign shrinks a
guided campaign's mutant or a failure whose shrinking by Hypothesis drifted: on traces of engine_tests/data that
campaigns saved unshrunk (86, 48 and 43 operations), each candidate replayed against the installed vLLM. The shrunk
trace must be shorter, fail with the same signature when replayed on its own, and still be the known bug (its cause
taken away, it passes: the signature tests' fixes).

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there, on both tested releases)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from engine_tests.test_vllm_scheduler_signatures import without_partial_hits
from kvfuzz.scheduler.replay import bounded_replay
from kvfuzz.scheduler.shrinking import shrink_trace
from kvfuzz.scheduler.signature import scheduler_signature
from kvfuzz.scheduler.trace import SchedulerTrace, load

DATA = Path(__file__).parent / "data"

CASES: dict[str, tuple[int, Callable[[SchedulerTrace, pytest.MonkeyPatch], SchedulerTrace] | None]] = {
    # trace -> the most operations its shrunk trace may keep, and its bug's cause taken away (None: not checked)
    "mamba-partial-hit-preempted-hang.json": (8, without_partial_hits),
    "mamba-checkpoint-partial-hit-stale-state.json": (6, None),
    "sessions-holding-waiting-deadlock.json": (16, None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_long_finding_shrinks_by_deletion_to_the_same_failure(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = load(DATA / name)
    found = bounded_replay(trace, 60.0)
    assert found.error is not None and found.reproduced, found.describe_failure()
    signature = scheduler_signature(trace.scheduler, found.error)
    shrunk = shrink_trace(trace, signature, lambda candidate: bounded_replay(candidate, 60.0), seconds=120.0)
    most, fixed = CASES[name]
    assert shrunk.stopped is None, shrunk.describe(len(trace.program))
    assert shrunk.error is not None and len(shrunk.trace.program) <= most < len(trace.program), shrunk.describe(
        len(trace.program)
    )
    again = bounded_replay(shrunk.trace, 60.0)
    assert again.error is not None and scheduler_signature(trace.scheduler, again.error) == signature
    assert again.identical, (again.failure, shrunk.trace.failure)  # its recorded words are its replay's
    if fixed is not None:  # still the known bug: without its cause the shrunk trace passes
        assert bounded_replay(fixed(shrunk.trace, monkeypatch), 60.0).error is None
