"""The scheduler campaigns' findings on vLLM 0.33.0 (issue 45, item 12; docs/scheduler-campaigns.md): a fixed bug
that comes back (patched in as engine_tests/vllm_history.py does) is a regression, not the known finding of its
corpus trace; a new livelock (preempted requests never resumed, seeded here) gets a signature of its own, apart
from the corpus's hangs; the ref_cnt finding of unmodified 0.33.0 under the offloading connector is the known
waiting-queue bug, one signature; an abort of a finished request is left out of the program."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import attrs
import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from engine_tests.vllm_history import priority_victim_stays_scheduled
from kvfuzz.campaign.known import known_findings
from kvfuzz.campaign.scheduler.target import SchedulerTraces, vllm_target
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.program import Abort
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.signature import scheduler_signature
from kvfuzz.scheduler.trace import load
from kvfuzz.scheduler.violations import Check, SchedulerViolation

CORPUS = Path(__file__).resolve().parent.parent / "corpus"
ISSUE_23347 = "vllm-v1-scheduler-issue-23347-victim-stays-scheduled-02ea5ce953c3.json"
HANGS = (
    "vllm-v1-scheduler-speculative-padding-hang-6123748f32e9.json",
    "vllm-v1-scheduler-offloading-load-gate-hang-v2-c7697394cd8d.json",
    "vllm-v1-scheduler-offloading-one-token-reload-hang-29b8f30c1dd1.json",
)


def test_a_fixed_bug_that_comes_back_is_a_regression_not_known(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copy(CORPUS / ISSUE_23347, tmp_path)
    clean = known_findings([tmp_path], SchedulerTraces(vllm_target("vllm-v1"), 60.0))
    assert not clean.known and not clean.regressions  # 0.33.0 as released: the trace passes
    priority_victim_stays_scheduled(monkeypatch)
    back = known_findings([tmp_path], SchedulerTraces(vllm_target("vllm-v1"), 60.0))
    assert not back.known, back.known  # counting it as known would hide the regression
    [(key, traces)] = back.regressions.items()
    assert "(fixed: vLLM issue #23347" in traces[0].where, (key, traces)


def never_resume_preempted(patch: pytest.MonkeyPatch) -> None:
    """A livelock seeded into ``schedule()``: once a request is preempted, the waiting queue is hidden while the
    scheduler schedules, so the preempted request is never resumed (no drafts, no connector needed), and no request
    is admitted ahead of it (which the order oracle would name first)."""
    original = Scheduler.schedule

    def schedule(self: Any) -> Any:
        preempted = any(request.status == RequestStatus.PREEMPTED for request in self.waiting)
        hidden = list(self.waiting) if preempted else []
        self.waiting.remove_requests(hidden)
        try:
            return original(self)
        finally:
            self.waiting.prepend_requests(hidden)

    patch.setattr(Scheduler, "schedule", schedule)


def test_a_new_livelock_is_keyed_apart_from_the_corpus_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    hangs = {str(scheduler_signature("vllm-v1", replay(load(CORPUS / name)).error)) for name in HANGS}  # type: ignore[arg-type]
    assert all(hang.startswith("progress: ") for hang in hangs), hangs
    never_resume_preempted(monkeypatch)
    # a sliding-window model: the liveness oracle's waiting-head promise, which would name the stuck request first,
    # is held for full attention alone (docs/oracles.md), so the hang reaches the progress check
    setup = SchedulerSetup(num_blocks=6, model="sliding-window")
    outcome = search(setup, examples=100, steps=50, shrink=False, seed=1)
    assert outcome.check() == Check.PROGRESS.value, outcome.describe()
    assert isinstance(outcome.failure, SchedulerViolation)
    livelock = str(scheduler_signature("vllm-v1", outcome.failure))
    assert "a preempted request never resumed (with neither drafts nor a KV connector" in livelock, livelock
    assert livelock not in hangs, (livelock, hangs)


def test_a_hang_under_partial_prefix_cache_hits_is_keyed_apart_from_the_hangs_without() -> None:
    """The Mamba partial-hit admission hang and a hang the same words would otherwise describe (a waiting request
    never admitted, neither drafts nor a connector, room in the pool) are two findings: the signature names the
    partial hits the configuration brings to the admission, so a campaign crediting the corpus's hang with a new one
    of the same state does not hide it. Without partial hits the words are as they were."""
    [partial] = CORPUS.glob("vllm-v1-scheduler-mamba-partial-hit-admission-hang-*.json")
    trace = load(partial)
    hang = str(scheduler_signature("vllm-v1", replay(trace).error))  # type: ignore[arg-type]
    assert hang == (
        "progress: a drain step scheduled nothing: a waiting request never admitted (with partial prefix-cache hits; "
        "the pool has room for it)"
    ), hang
    error = replay(attrs.evolve(trace, setup=attrs.evolve(trace.setup, prefix_match_unit=0))).error
    assert error is None, "without partial hits the request is admitted"


def test_the_shared_block_ref_cnt_finding_is_the_waiting_queue_bug() -> None:
    [shared] = CORPUS.glob("vllm-v1-scheduler-offloading-shared-block-ref-cnt-*.json")
    [waiting] = CORPUS.glob("vllm-v1-scheduler-offloading-waiting-queue-holds-blocks-*.json")
    signatures = []
    for path in (shared, waiting):
        replayed = replay(load(path))
        assert replayed.reproduced and replayed.error is not None, replayed.describe_failure()
        signatures.append(str(scheduler_signature("vllm-v1", replayed.error)))
    assert signatures == ["accounting: blocks held by a request in the waiting queue"] * 2
    described = replay(load(shared)).describe_failure()
    assert "ref_cnt 2; block 2 in vLLM's own table for r9 (WAITING, 0 computed" in described, described


def test_an_abort_of_a_finished_request_is_left_out_of_the_program() -> None:
    session = Session(SchedulerSetup(num_blocks=8))
    request = session.add([1, 2, 3], 1)
    while session.busy():
        session.step()
    session.abort(request)
    session.abort(request)
    assert not [operation for operation in session.program if isinstance(operation, Abort)], session.program
    other = session.add([1, 2], 4)
    session.abort(other)  # a live request's abort is an operation
    assert session.program[-1] == Abort(other)
