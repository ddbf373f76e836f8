"""Historical bugs (docs/scheduler-history.md): scheduler-level KV-cache bugs of vLLM v1's past, patched back into vLLM
0.33.0 at runtime (engine_tests/vllm_history.py), are found by the scheduler target from random requests, and the
same derandomized search passes on 0.33.0 as released, which has the fixes. Each bug's shrunk program is also
replayed as Hypothesis printed it, so the finding stays pinned whatever the search's order of examples becomes.
Two are admission bugs of the prefix cache (FCFS), two are bugs of priority preemption (the priority policy).

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``); without vLLM 0.33.0 the import fails loudly."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from engine_tests.vllm_history import (
    capacity_check_ignores_evictable_hits,
    priority_victim_keeps_its_tokens,
    priority_victim_stays_scheduled,
    touch_before_the_capacity_check,
)
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.machine import machine_for_setup
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.trace import load
from kvfuzz.scheduler.violations import Check, SchedulerViolation
from kvfuzz.scheduler.vllm_release import vllm_release

SMALL = SchedulerSetup(num_blocks=8)  # a pool small enough that admissions are refused and hits are evicted
PRIORITY = SchedulerSetup(num_blocks=8, policy="priority")  # the same pool under the priority policy
EXAMPLES = 60  # the search's budget; each bug is found within its first 20 examples
STEPS = 50


def test_issue_11562_a_refused_admission_leaks_its_hit_references(monkeypatch: pytest.MonkeyPatch) -> None:
    """Touch before the capacity check: a request refused for want of blocks keeps a reference on each of its
    prefix-hit blocks; the accounting check sees a ref_cnt that no table accounts for."""
    touch_before_the_capacity_check(monkeypatch)
    outcome = search(SMALL, examples=EXAMPLES, steps=STEPS, shrink=False)
    assert outcome.check() == Check.ACCOUNTING.value, outcome.describe()
    assert re.search(
        r"accounting check failed at step \d+, request r\d+: block \d+ is held by the tables of (\d+) running "
        r"request\(s\) \[[^]]*\] \(expected ref_cnt \1, not free\), but the manager's block has ref_cnt \d+",
        outcome.explanation(),
    ), outcome.explanation()


def test_pull_11565_s_review_a_capacity_check_blind_to_evictable_hits_crashes_the_scheduler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The capacity check counts no evictable hit block: touching them empties the free queue under the admitted
    request, and vLLM's block pool raises inside schedule(), reported as a crash with its program."""
    capacity_check_ignores_evictable_hits(monkeypatch)
    outcome = search(SMALL, examples=EXAMPLES, steps=STEPS, shrink=False)
    assert outcome.check() == "crash", outcome.describe()
    assert outcome.explanation() == "crash: ValueError: Cannot get 1 free blocks from the pool", outcome.explanation()
    assert "state.add_request(" in outcome.program and "state.step()" in outcome.program, outcome.program


def test_the_same_search_passes_with_the_fixes() -> None:
    """vLLM 0.33.0 as released (both fixes in): the derandomized search that fails within its first 20 examples
    under either patch runs all its examples clean, through refused admissions, preemptions and hits."""
    outcome = search(SMALL, examples=EXAMPLES, steps=STEPS, shrink=False)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.examples >= EXAMPLES and outcome.preemptions > 0 and outcome.hit_tokens > 0, outcome.describe()


def replay_issue_11562_s_shrunk_program() -> None:
    """The program Hypothesis shrank the issue 11562 failure to (docs/scheduler-history.md), replayed as printed."""
    state = machine_for_setup(SMALL)()
    state.add_request(max_tokens=1, prefix=0, suffix=[])
    state.step()
    state.step()
    state.add_request(max_tokens=2, prefix=6, suffix=[0, 0, 0, 0, 0, 0])
    state.step()
    state.add_request(max_tokens=1, prefix=6, suffix=[0, 2, 0])
    state.add_request(max_tokens=1, prefix=8, suffix=[0, 0, 0, 0, 0])
    state.step()
    state.teardown()


def replay_the_evictable_hits_shrunk_program() -> None:
    """The program Hypothesis shrank the evictable-hits failure to (docs/scheduler-history.md), replayed as printed."""
    state = machine_for_setup(SMALL)()
    state.add_request(max_tokens=5, prefix=0, suffix=[0, 0])
    state.add_request(max_tokens=5, prefix=8, suffix=[0, 0, 0, 0, 0, 0])
    state.step()
    state.step()
    state.add_request(max_tokens=2, prefix=0, suffix=[0, 0, 0, 0])
    state.step()
    state.step()
    state.step()
    state.teardown()


def test_issue_11562_s_shrunk_program_fails_with_the_bug_and_passes_without(monkeypatch: pytest.MonkeyPatch) -> None:
    replay_issue_11562_s_shrunk_program()
    touch_before_the_capacity_check(monkeypatch)
    with pytest.raises(SchedulerViolation) as caught:
        replay_issue_11562_s_shrunk_program()
    assert caught.value.check is Check.ACCOUNTING
    assert re.search(r"at step 4, request r1: block 1 is held by .* ref_cnt 3", str(caught.value)), caught.value


def test_the_evictable_hits_shrunk_program_fails_with_the_bug_and_passes_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    replay_the_evictable_hits_shrunk_program()
    capacity_check_ignores_evictable_hits(monkeypatch)
    with pytest.raises(ValueError, match="Cannot get 1 free blocks from the pool"):
        replay_the_evictable_hits_shrunk_program()


ASSERTIONS_23347 = {
    "0.33.0": "crash: AssertionError at vllm/v1/core/sched/scheduler.py:1637 in schedule(): assert "
    "len(scheduled_new_reqs) + len(scheduled_resumed_reqs) + len(scheduled_running_reqs) <= len(self.running)",
    # 0.34.0 removed Model Runner V1, and with it the resumed requests' list: the same assertion, one term fewer
    "0.34.0": "crash: AssertionError at vllm/v1/core/sched/scheduler.py:1710 in schedule(): assert "
    "len(scheduled_new_reqs) + len(scheduled_running_reqs) <= len(self.running)",
}
ASSERTION_23347 = ASSERTIONS_23347[vllm_release().version]
"""vLLM's own assertion that issue 23347 reported, as kvfuzz tells a crash without a message, in the installed
release's words."""


def test_issue_23347_a_priority_victim_scheduled_earlier_in_the_step_stays_scheduled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The victim of priority preemption, scheduled earlier in the same step, stays among the step's scheduled
    running requests: vLLM's own assertion (the issue's report) fails inside schedule()."""
    priority_victim_stays_scheduled(monkeypatch)
    outcome = search(PRIORITY, examples=EXAMPLES, steps=STEPS, shrink=False)
    assert outcome.check() == "crash", outcome.describe()
    assert outcome.explanation() == ASSERTION_23347, outcome.explanation()


def test_issue_23347_is_caught_by_the_batch_check_where_vllm_runs_without_assertions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the patched method compiled as ``python -O`` compiles it (vLLM's assertion gone), the output reaches
    the worker, and kvfuzz's own batch check names the request the output both schedules as running and
    preempts."""
    priority_victim_stays_scheduled(monkeypatch, assertions=False)
    outcome = search(PRIORITY, examples=EXAMPLES, steps=STEPS, shrink=False)
    assert outcome.check() == Check.BATCH.value, outcome.describe()
    assert re.fullmatch(
        r"batch check failed at step \d+, request (r\d+): the output schedules it as a running request for \d+ "
        r"token\(s\), and the same output preempts it \(preempted \[[^]]*'\1'[^]]*\]\)",
        outcome.explanation(),
    ), outcome.explanation()


def test_issue_23316_a_priority_victim_keeps_its_scheduled_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """After pull 23713 the victim leaves the scheduled running requests but keeps its scheduled tokens and new
    blocks: the output schedules tokens for a request it gives the model runner no table for (the batch check)."""
    priority_victim_keeps_its_tokens(monkeypatch)
    outcome = search(PRIORITY, examples=EXAMPLES, steps=STEPS, shrink=False)
    assert outcome.check() == Check.BATCH.value, outcome.describe()
    assert re.fullmatch(
        r"batch check failed at step \d+, request r\d+: the step schedules \d+ token\(s\) for it \(the same output "
        r"preempts it\), but the output brings it neither as a new nor as a cached request, so the model runner has "
        r"no table for it; new \[[^]]*\], cached \[[^]]*\]",
        outcome.explanation(),
    ), outcome.explanation()


def test_the_same_priority_search_passes_with_the_fixes() -> None:
    outcome = search(PRIORITY, examples=EXAMPLES, steps=STEPS, shrink=False)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.examples >= EXAMPLES and outcome.preemptions > 0 and outcome.hit_tokens > 0, outcome.describe()


def replay_the_priority_victims_shrunk_program() -> None:
    """The program Hypothesis shrank both priority bugs to on 8 blocks (docs/scheduler-history.md), replayed as printed:
    r0 and r2 of priority 0, r1 of priority 1, whose blocks r2's admission and growth leave short."""
    state = machine_for_setup(PRIORITY)()
    state.add_request(max_tokens=7, prefix=0, priority=0, suffix=[0, 0, 0])
    state.step()
    state.step()
    state.step()
    state.add_request(max_tokens=4, prefix=0, priority=1, suffix=[0, 0, 0, 0, 0, 0])
    state.step()
    state.step()
    state.add_request(max_tokens=2, prefix=4, priority=0, suffix=[0, 0, 0, 0])
    state.step()
    state.step()
    state.teardown()


def test_the_priority_victims_shrunk_program_fails_with_either_bug_and_passes_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    replay_the_priority_victims_shrunk_program()
    with monkeypatch.context() as patch:
        priority_victim_stays_scheduled(patch)
        with pytest.raises(AssertionError):
            replay_the_priority_victims_shrunk_program()
    priority_victim_keeps_its_tokens(monkeypatch)
    with pytest.raises(SchedulerViolation) as caught:
        replay_the_priority_victims_shrunk_program()
    assert caught.value.check is Check.BATCH
    assert str(caught.value).startswith(
        "batch check failed at step 7, request r1: the step schedules 1 token(s) for it (the same output preempts it)"
    ), caught.value


CORPUS = Path(__file__).resolve().parent.parent / "corpus"


@pytest.mark.parametrize(
    ("file", "patch"),
    [
        ("vllm-v1-scheduler-issue-11562-touch-first-3e993e943ea3.json", touch_before_the_capacity_check),
        ("vllm-v1-scheduler-pull-11565-evictable-hits-61fdff1af58a.json", capacity_check_ignores_evictable_hits),
        ("vllm-v1-scheduler-issue-23347-victim-stays-scheduled-02ea5ce953c3.json", priority_victim_stays_scheduled),
        ("vllm-v1-scheduler-issue-23316-victim-keeps-tokens-02ea5ce953c3.json", priority_victim_keeps_its_tokens),
    ],
)
def test_each_bug_s_corpus_trace_reproduces_it_word_for_word_and_replays_clean_without_it(
    file: str, patch: Callable[[pytest.MonkeyPatch], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = load(CORPUS / file)
    assert trace.known_bug is None  # a regression trace: the pytest plugin fails it the day the failure comes back
    clean = replay(trace)
    assert not clean.failed, clean.describe_failure()
    patch(monkeypatch)
    again = replay(trace)
    # word for word; but a crash without a message names the line of vLLM's assertion, which another release moved
    elsewhere = trace.vllm_version != vllm_release().version
    reworded = elsewhere and again.describe_failure() == ASSERTION_23347
    assert again.reproduced and (again.identical or reworded), again.describe_failure()
