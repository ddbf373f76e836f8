"""Known vLLM bugs met under other signatures (engine_tests/data/, which campaigns measuring coverage credit with
``--known engine_tests/data``): each trace a ten-minute campaign saved as new replays word for word, and passes with
its bug's cause taken away, so that it is the known bug and not another. Their reproducers are not written (the
standalone reproducer plays neither async scheduling, the P/D connector, the stats check nor pauses), so they are
kept here rather than in corpus/. One was first read as another bug: the Mamba sessions' progress failure, which
passes with the Mamba session resume gate hang's cause taken away.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import attrs
import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from engine_tests.test_vllm_scheduler_offloading import asked_once_after_its_load
from engine_tests.test_vllm_scheduler_sessions import skipped_blocks_freed_before_the_gate
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.trace import SchedulerTrace, load

DATA = Path(__file__).parent / "data"


def without_partial_hits(trace: SchedulerTrace, monkeypatch: pytest.MonkeyPatch) -> SchedulerTrace:
    """The Mamba partial-hit admission hang's cause taken away: no partial prefix-cache hits."""
    return attrs.evolve(trace, setup=attrs.evolve(trace.setup, prefix_match_unit=0))


def reload_fixed(trace: SchedulerTrace, monkeypatch: pytest.MonkeyPatch) -> SchedulerTrace:
    """The one-token reload hang's cause taken away: the connector is not asked again for a request whose load just
    finished (the offloading engine test's fix)."""
    asked_once_after_its_load(monkeypatch)
    return trace


def gate_without_spec_reservation(trace: SchedulerTrace, monkeypatch: pytest.MonkeyPatch) -> SchedulerTrace:
    """The async-load gate hang's cause taken away: the gate reserves no spec-decode step blocks."""
    init = Scheduler.__init__

    def construct(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._spec_decode_step_blocks = 0

    monkeypatch.setattr(Scheduler, "__init__", construct)
    return trace


def gate_after_the_skip(trace: SchedulerTrace, monkeypatch: pytest.MonkeyPatch) -> SchedulerTrace:
    """The Mamba session resume gate hang's cause taken away: the full-sequence gate counts the free blocks after the
    Mamba group's skipped blocks are freed."""
    skipped_blocks_freed_before_the_gate(monkeypatch)
    return trace


CAUSES: dict[str, Callable[[SchedulerTrace, pytest.MonkeyPatch], SchedulerTrace]] = {
    "mamba-partial-hit-preempted-hang.json": without_partial_hits,
    "offloading-one-token-reload-starves-waiting.json": reload_fixed,
    "offloading-load-gate-preempted-hang.json": gate_without_spec_reservation,
    "offloading-one-token-reload-with-drafts.json": reload_fixed,
    "pd-load-gate-hang.json": gate_without_spec_reservation,
    "pd-mamba-partial-hit-admission-hang.json": without_partial_hits,
    "pd-mamba-partial-hit-drain-hang.json": without_partial_hits,
    "pd-mamba-partial-hit-preempted-hang.json": without_partial_hits,
    "sessions-holding-waiting-deadlock.json": gate_after_the_skip,
}


@pytest.mark.parametrize("name", sorted(CAUSES))
def test_a_known_bug_under_another_signature_replays_and_passes_without_its_cause(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = load(DATA / name)
    assert trace.known_bug and "the same vLLM bug as" in trace.known_bug
    replayed = replay(trace)
    assert replayed.reproduced and replayed.identical, replayed.describe_failure()
    without = replay(CAUSES[name](trace, monkeypatch))
    assert not without.reproduced and without.failure is None, without.describe_failure()
