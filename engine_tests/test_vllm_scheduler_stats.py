"""vLLM's scheduler stats (``log_stats``) checked against the pool and the requests (kvfuzz/scheduler/stats.py,
docs/scheduler-features.md): the unmodified scheduler passes with them on; each seeded bug is caught, from
hand-written requests with its message, and from random requests with the trace that replays it.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there): without vLLM the import fails
loudly rather than skipping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core import block_pool, kv_cache_manager
from vllm.v1.core.sched import scheduler as scheduler_module

from engine_tests.vllm_seeded_runs import found_and_replayed, run_until_finished
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.stats import StatsLedger
from kvfuzz.scheduler.violations import Check, SchedulerViolation

PREFIX = [1, 2, 3, 0, 2, 2, 1, 3]  # two full blocks of 4


def usage_counts_the_null_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the pool's usage divides by every block, the null block included (which is never free)."""
    monkeypatch.setattr(
        block_pool.BlockPool, "get_usage", lambda self: 1.0 - self.get_num_free_blocks() / self.num_gpu_blocks
    )


def loading_requests_uncounted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the request counts leave out the requests waiting with blocks (a KV load in flight)."""
    monkeypatch.setattr(
        scheduler_module.Scheduler, "get_request_counts", lambda self: (len(self.running), len(self.waiting))
    )


def resumed_counted_as_new(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a request back after a preemption is counted among the new requests' lookups."""
    original = kv_cache_manager.KVCacheManager.record_prefix_cache_stats

    def record(self: Any, request: Any, num_hits: int) -> None:
        preemptions = request.num_preemptions
        request.num_preemptions = 0
        try:
            original(self, request, num_hits)
        finally:
            request.num_preemptions = preemptions

    monkeypatch.setattr(kv_cache_manager.KVCacheManager, "record_prefix_cache_stats", record)


def stats_only_with_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: ``update_from_output`` drops the stats of a step that returns no request output."""
    original = scheduler_module.Scheduler.update_from_output

    def update(self: Any, *args: Any, **kwargs: Any) -> Any:
        outputs = original(self, *args, **kwargs)
        for eco in outputs.values():
            if not eco.outputs:
                eco.scheduler_stats = None
        return outputs

    monkeypatch.setattr(scheduler_module.Scheduler, "update_from_output", update)


def test_the_unmodified_scheduler_passes_with_stats_on() -> None:
    for setup in (
        SchedulerSetup(num_blocks=8, stats=True),
        SchedulerSetup(num_blocks=8, stats=True, async_scheduling=True, policy="priority"),
        SchedulerSetup(num_blocks=8, stats=True, kv_connector="offloading", transfer_delay=2),
    ):
        outcome = search(setup, examples=25, steps=30)
        assert outcome.failure is None, f"{setup.describe()}: {outcome.failure}\n{outcome.program}"
        assert outcome.preemptions > 0, outcome.describe()


def test_the_lookups_counted_are_the_admissions_hand_counted() -> None:
    """One request computes two blocks; a second with the same prefix is admitted with an 8-token hit: the stats of
    that step count one lookup of 10 tokens (its prompt) and 8 hits, and nothing after."""
    session = Session(SchedulerSetup(stats=True))
    run_until_finished(session, session.add(PREFIX + [0], 1))
    assert isinstance(session.stats, StatsLedger)
    seen: list[Any] = []
    original = session.stats._lookups
    session.stats._lookups = lambda found, expected, step: (seen.append(found), original(found, expected, step))[-1]  # type: ignore[method-assign]
    session.add(PREFIX + [1, 1], 2)
    session.step()
    session.drain()
    first = seen[0]
    assert (first.requests, first.queries, first.hits, first.preempted_requests) == (1, 10, 8, 0)
    assert all(later.requests == 0 for later in seen[1:])


def test_a_usage_counting_the_null_block_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 usable blocks and the null block: 3 held is 3/16, the bug's 4/17 counts the null block as held."""
    usage_counts_the_null_block(monkeypatch)
    session = Session(SchedulerSetup(stats=True))
    session.add(PREFIX + [0], 4)
    with pytest.raises(SchedulerViolation) as caught:
        session.step()
    assert str(caught.value) == (
        "stats check failed at step 1: the stats report KV cache usage 0.2353, but requests hold 3 of the pool's 16 "
        "usable blocks (0.1875; held: [1, 2, 3])"
    )


def test_a_resumed_request_counted_as_new_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    resumed_counted_as_new(monkeypatch)
    session = Session(SchedulerSetup(num_blocks=4, max_num_seqs=2, stats=True))
    session.add([0, 1, 2, 3, 0], 6)
    session.add([3, 2, 1, 0, 3], 6)
    with pytest.raises(SchedulerViolation) as caught:
        session.drain()  # the two cannot both grow in 3 usable blocks: one is preempted, and resumes
    violation = caught.value
    assert (violation.check, violation.cause) == (Check.STATS, "prefix-cache lookups"), violation
    assert "requests 1 (expected 0)" in str(violation) and "preempted_requests 0 (expected 1)" in str(violation)


def test_stats_dropped_from_a_step_without_outputs_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    stats_only_with_outputs(monkeypatch)
    session = Session(SchedulerSetup(stats=True, max_num_batched_tokens=4))
    session.add(PREFIX + [0], 2)
    with pytest.raises(SchedulerViolation) as caught:
        session.step()  # a prefill chunk: no output yet
    assert str(caught.value) == (
        "stats check failed at step 1: update_from_output() returned 0 SchedulerStats with log_stats on: one each time"
    )


@pytest.mark.parametrize(
    "bug, options, named",
    [
        (usage_counts_the_null_block, ["--stats"], "KV cache usage"),
        (
            loading_requests_uncounted,
            ["--stats", "--kv-connector", "offloading", "--transfer-delay", "2"],
            "unfinished",
        ),
        (resumed_counted_as_new, ["--stats"], "preempted_requests"),
        (stats_only_with_outputs, ["--stats"], "SchedulerStats"),
    ],
)
def test_each_seeded_bug_is_found_from_random_requests_and_its_trace_replays(
    bug: Any,
    options: list[str],
    named: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bug(monkeypatch)
    found_and_replayed(capsys, tmp_path / "corpus", options, {Check.STATS}, named)
    monkeypatch.undo()
