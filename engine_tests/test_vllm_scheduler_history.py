"""Historical bugs (docs/scheduler.md): two scheduler-level KV-cache bugs from vLLM v1's history, patched back into
vLLM 0.33.0 at runtime (engine_tests/vllm_history.py), are found by the scheduler target from random requests, and
the same derandomized search passes on 0.33.0 as released, which has both fixes. Each bug's shrunk program is also
replayed as Hypothesis printed it, so the finding stays pinned whatever the search's order of examples becomes.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``); without vLLM 0.33.0 the import fails loudly."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from engine_tests.vllm_history import capacity_check_ignores_evictable_hits, touch_before_the_capacity_check
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.machine import machine_for_setup
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.trace import load
from kvfuzz.scheduler.violations import Check, SchedulerViolation

SMALL = SchedulerSetup(num_blocks=8)  # a pool small enough that admissions are refused and hits are evicted
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
    """The program Hypothesis shrank the issue 11562 failure to (docs/scheduler.md), replayed as printed."""
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
    """The program Hypothesis shrank the evictable-hits failure to (docs/scheduler.md), replayed as printed."""
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


CORPUS = Path(__file__).resolve().parent.parent / "corpus"


@pytest.mark.parametrize(
    ("file", "patch"),
    [
        ("vllm-v1-scheduler-issue-11562-touch-first-3e993e943ea3.json", touch_before_the_capacity_check),
        ("vllm-v1-scheduler-pull-11565-evictable-hits-61fdff1af58a.json", capacity_check_ignores_evictable_hits),
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
    assert again.reproduced and again.identical, again.describe_failure()
