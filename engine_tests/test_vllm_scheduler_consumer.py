"""kvfuzz's P/D-disaggregation connector (docs/scheduler-connectors.md#the-pd-connector): vLLM's scheduler with a
KV consumer and producer, remote prefixes loaded into requests' blocks, finished requests sent (their frees delayed
until the send is reported), and under async scheduling vLLM's deferred block frees. The unmodified scheduler passes
with every kind reached; each bug seeded into vLLM is caught by the check it breaks.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

import attrs
import pytest
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler

from engine_tests.vllm_seeded_runs import found_and_replayed
from kvfuzz.reproducer_text import NotReproducible
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.offloading import TransferTally
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.reproducer import check_reproducible
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.trace import load
from kvfuzz.scheduler.violations import Check, SchedulerViolation

SYNC = SchedulerSetup(num_blocks=8, block_size=2, kv_connector="pd", transfer_delay=2)
ASYNC = attrs.evolve(SYNC, async_scheduling=True)
FAILING = attrs.evolve(SYNC, load_failures=True)
FAILING_ASYNC = attrs.evolve(ASYNC, load_failures=True)
FAILING_FAIL = attrs.evolve(FAILING, load_failure_policy="fail")
FAILING_FAIL_ASYNC = attrs.evolve(FAILING_ASYNC, load_failure_policy="fail")


def run_examples(setup: SchedulerSetup, examples: int) -> TransferTally:
    """Random request programs (shared prefixes, aborts, a small pool), each drained; the summed transfer tally."""
    total = TransferTally()
    for example in range(examples):
        rng = random.Random(example)
        session = Session(setup)
        for _ in range(30):
            draw = rng.random()
            if draw < 0.35:
                prompt = [1, 2, 3, 1, 2, 3, 1, 2][: rng.randint(1, 8)] + [rng.randint(0, 3)] * rng.randint(0, 2)
                session.add(prompt, rng.randint(1, 4))
            elif draw < 0.42 and session.lengths:
                session.abort(f"r{rng.randrange(len(session.lengths))}")
            else:
                session.step()
        session.drain()
        total.add(session.connector.tally)
    return total


def first_failure(setup: SchedulerSetup, examples: int = 40) -> SchedulerViolation:
    """The first violation the random programs of :func:`run_examples` meet (the test fails if none does)."""
    with pytest.raises(SchedulerViolation) as raised:
        run_examples(setup, examples)
    return raised.value


@pytest.mark.parametrize("setup", [SYNC, ASYNC], ids=["sync", "async"])
def test_the_unmodified_scheduler_passes_with_every_transfer_kind_reached(setup: SchedulerSetup) -> None:
    tally = run_examples(setup, 12)
    assert tally.loads > tally.sync_loads > 0 and tally.sends > 0 and tally.late > 0, tally
    assert (tally.deferred > 0) == setup.async_scheduling, tally


@pytest.mark.parametrize("setup", [FAILING, FAILING_ASYNC], ids=["sync", "async"])
def test_the_unmodified_scheduler_recovers_from_failed_loads(setup: SchedulerSetup) -> None:
    """Async loads fail part-way (invalid blocks) or whole (a failed receive): vLLM recomputes what they did not
    fill, and every check passes."""
    tally = run_examples(setup, 12)
    assert tally.loads > tally.failed_loads > 0, tally


@pytest.mark.parametrize("setup", [FAILING_FAIL, FAILING_FAIL_ASYNC], ids=["sync", "async"])
def test_under_the_fail_policy_a_failed_load_s_request_finishes_with_an_error(
    monkeypatch: pytest.MonkeyPatch, setup: SchedulerSetup
) -> None:
    """vLLM's kv_load_failure_policy "fail": every request whose load failed (part-way or whole) finishes with
    reason error, and every check passes; the other requests finish as they would."""
    errors: list[str] = []
    original = Scheduler.finish_requests

    def finish_requests(self: Any, request_ids: Any, status: Any) -> Any:
        finished = original(self, request_ids, status)
        if status.name == "FINISHED_ERROR":
            errors.extend(request.request_id for request in finished or ())
        return finished

    monkeypatch.setattr(Scheduler, "finish_requests", finish_requests)
    assert Session(setup).scheduler.recompute_kv_load_failures is False
    tally = run_examples(setup, 12)
    assert tally.loads > tally.failed_loads > 0, tally
    assert len(errors) == tally.failed_loads, (errors, tally)


def test_a_load_failing_part_way_reports_its_unfilled_blocks_and_vllm_recomputes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The connector's report names the blocks past the first failed one, and vLLM truncates the request's computed
    tokens to the failed block's start (its recovery ran, not only kvfuzz's report)."""
    truncated: list[tuple[set[int], set[str]]] = []
    original = Scheduler._handle_invalid_blocks

    def handle(self: Any, invalid: set[int], scheduled: dict[str, int]) -> set[str]:
        before = {request.request_id: request.num_computed_tokens for request in self.kv_holding_waiting}
        result = original(self, invalid, scheduled)
        after = {request.request_id: request.num_computed_tokens for request in self.kv_holding_waiting}
        truncated.append((set(invalid), {request for request in before if after.get(request) != before[request]}))
        return result

    monkeypatch.setattr(Scheduler, "_handle_invalid_blocks", handle)
    run_examples(FAILING, 12)
    assert truncated and all(invalid for invalid, _ in truncated), truncated
    assert any(requests for _, requests in truncated), "no failed load made vLLM truncate a request"


def test_async_scheduling_with_the_consumer_turns_deferred_frees_on() -> None:
    assert Session(ASYNC).scheduler.defer_block_free
    assert not Session(SYNC).scheduler.defer_block_free
    assert not Session(attrs.evolve(ASYNC, kv_connector="none", transfer_delay=0)).scheduler.defer_block_free


def test_a_sent_request_keeps_its_whole_table_not_only_its_computed_tokens_blocks() -> None:
    """vLLM hands the connector the blocks of a finished request's computed tokens, and keeps its whole table (a
    draft's lookahead slot's block too) until the send is reported: the accounting counts them all (a pinned
    campaign's first finding counted only the former)."""
    session = Session(SchedulerSetup(num_blocks=6, max_num_batched_tokens=4, speculative_tokens=1, kv_connector="pd"))
    session.add([0, 0, 0, 0], 1)
    session.step()  # r0 finishes: its send delays the free of its prompt's block and its lookahead slot's
    session.step()  # the send is ordered, and the accounting checked
    session.drain()
    assert session.connector.tally.sends == 1


# -- bugs seeded into vLLM's scheduler ------------------------------------------------------------------------------


def frees_not_deferred(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a released request's blocks go back to the pool at once, whatever step in flight still reads
    them (``_request_blocks_can_be_freed`` always says yes)."""
    monkeypatch.setattr(Scheduler, "_request_blocks_can_be_freed", lambda self, request: True)


def delayed_free_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a finished request whose send the connector delays its free for has its blocks freed all the
    same (vLLM keeps the request, and frees nothing more when the send is reported)."""
    original = Scheduler._free_request

    def free_request(self: Any, request: Any, delay_free_blocks: bool = False) -> Any:
        result = original(self, request, delay_free_blocks)
        if request.request_id in self.requests:  # kept for a transfer in flight: its blocks freed anyway
            self.kv_cache_manager.free(request)
        return result

    monkeypatch.setattr(Scheduler, "_free_request", free_request)


def sent_blocks_leaked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a request whose send is reported is forgotten without its blocks being freed."""
    original = Scheduler._update_from_kv_xfer_finished

    def update(self: Any, output: Any) -> None:
        for request in output.finished_sending or ():
            del self.requests[request]
        output.finished_sending = None
        original(self, output)

    monkeypatch.setattr(Scheduler, "_update_from_kv_xfer_finished", update)


def aborted_load_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a request aborted while its remote load is in flight has its blocks freed at once (the delay
    ``finish_requests`` asks for is dropped), so the load lands in blocks it no longer holds."""
    original = Scheduler._free_request
    monkeypatch.setattr(
        Scheduler, "_free_request", lambda self, request, delay_free_blocks=False: original(self, request, False)
    )


def _retruncated(monkeypatch: pytest.MonkeyPatch, computed: Callable[[int, int, int], int]) -> None:
    """Wraps vLLM's ``_update_requests_with_invalid_blocks``: each request it found affected by a failed load is
    left with ``computed(tokens before, tokens vLLM truncated it to, block size)`` computed tokens."""
    original = Scheduler._update_requests_with_invalid_blocks

    def update(
        self: Any, requests: Any, invalid: set[int], scheduled: dict[str, int], evict_blocks: bool = True
    ) -> Any:
        requests = list(requests)
        before = {request.request_id: request.num_computed_tokens for request in requests}
        affected, tokens, evict = original(self, requests, invalid, scheduled, evict_blocks)
        for request in requests:
            if request.request_id in affected:
                kept = before[request.request_id]
                request.num_computed_tokens = computed(kept, request.num_computed_tokens, self.block_size)
        return affected, tokens, evict

    monkeypatch.setattr(Scheduler, "_update_requests_with_invalid_blocks", update)


def invalid_blocks_kept_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a load that failed part-way is reported, but the requests holding its blocks keep every loaded
    token counted as computed (``_update_requests_with_invalid_blocks`` finds the affected requests and truncates
    none)."""
    _retruncated(monkeypatch, lambda before, truncated, block_size: before)


def truncated_past_the_failed_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug, an off-by-one: a request a part-way failed load affected is truncated to the end of its first
    failed block rather than its start, so that block's positions count as computed."""
    _retruncated(monkeypatch, lambda before, truncated, block_size: min(truncated + block_size, before))


def failed_receive_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a load the connector reports failed whole (``failed_recving``) is taken for a finished one: the
    request keeps its remote prefix counted as computed."""
    monkeypatch.setattr(Scheduler, "_handle_failed_recving", lambda self, failed: set())


def _policy_ignored(monkeypatch: pytest.MonkeyPatch, recompute: bool) -> None:
    init = Scheduler.__init__

    def construct(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.recompute_kv_load_failures = recompute

    monkeypatch.setattr(Scheduler, "__init__", construct)


def failure_recomputed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the scheduler recomputes a failed load whatever the configured policy (its "fail" ignored)."""
    _policy_ignored(monkeypatch, recompute=True)


def failure_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the scheduler fails the request of a failed load whatever the configured policy (its "recompute"
    ignored)."""
    _policy_ignored(monkeypatch, recompute=False)


def async_load_cached_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the blocks of an async load are cached (given their block hashes) as they are allocated, not once
    the load filled them (``delay_cache_blocks`` ignored)."""
    allocate = KVCacheManager.allocate_slots

    def allocate_slots(self: Any, *args: Any, **kwargs: Any) -> Any:
        return allocate(self, *args, **{**kwargs, "delay_cache_blocks": False})

    monkeypatch.setattr(KVCacheManager, "allocate_slots", allocate_slots)


SeededBug = tuple[Callable[[pytest.MonkeyPatch], None], SchedulerSetup, Check, str]
"""A bug seeded into vLLM (a function monkeypatching it), the setup the random programs of :func:`run_examples` run
on, and the check and cause that must catch it."""


def seeded_bugs_caught(cases: dict[str, SeededBug]) -> Callable[..., None]:
    """A test, one case per entry of ``cases`` (its id -> :data:`SeededBug`): with the bug seeded, the first failure
    the random programs meet is the named check's, for the named cause."""

    @pytest.mark.parametrize(("bug", "setup", "check", "cause"), list(cases.values()), ids=list(cases))
    def test(
        monkeypatch: pytest.MonkeyPatch,
        bug: Callable[[pytest.MonkeyPatch], None],
        setup: SchedulerSetup,
        check: Check,
        cause: str,
    ) -> None:
        bug(monkeypatch)
        failure = first_failure(setup)
        assert (failure.check, failure.cause) == (check, cause), failure

    return test


test_a_seeded_vllm_bug_is_caught = seeded_bugs_caught(
    {
        "invalid-kept": (
            invalid_blocks_kept_computed,
            FAILING,
            Check.CONTENT,
            "a block a failed connector load never filled",
        ),
        "failed-receive-ignored": (
            failed_receive_ignored,
            FAILING,
            Check.CONTENT,
            "a block a failed connector load never filled",
        ),
        "truncated-past-failed-block": (
            truncated_past_the_failed_block,
            FAILING,
            Check.CONTENT,
            "a block a failed connector load never filled",
        ),
        "not-deferred": (frees_not_deferred, ASYNC, Check.DELAYED_FREE, "a deferred free returned early"),
        "delay-ignored-sync": (
            delayed_free_ignored,
            SYNC,
            Check.DELAYED_FREE,
            "a delayed free returned before its send",
        ),
        "delay-ignored-async": (
            delayed_free_ignored,
            ASYNC,
            Check.DELAYED_FREE,
            "a delayed free returned before its send",
        ),
        "sent-leaked": (sent_blocks_leaked, SYNC, Check.ACCOUNTING, "the free count"),
        "abort-sync": (aborted_load_freed, SYNC, Check.TRANSFER, "a load into a block its request does not hold"),
        "abort-async": (aborted_load_freed, ASYNC, Check.TRANSFER, "a load into a block its request does not hold"),
        "fail-recomputed-sync": (failure_recomputed, FAILING_FAIL, Check.OUTPUTS, "a failed load's request not failed"),
        "fail-recomputed-async": (
            failure_recomputed,
            FAILING_FAIL_ASYNC,
            Check.OUTPUTS,
            "a failed load's request not failed",
        ),
        "fail-receive-ignored": (
            failed_receive_ignored,
            FAILING_FAIL,
            Check.OUTPUTS,
            "a failed load's request not failed",
        ),
        "recompute-failed": (failure_failed, FAILING, Check.OUTPUTS, "an error finish without a failed load"),
        "cached-early-sync": (async_load_cached_early, SYNC, Check.TRANSFER, "a load's block with a block hash"),
        "cached-early-async": (async_load_cached_early, ASYNC, Check.TRANSFER, "a load's block with a block hash"),
    }
)


def test_a_seeded_bug_is_found_by_a_run_and_its_trace_replays(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvfuzz run --kv-connector pd --async-scheduling`` finds the undeferred frees, and its trace replays."""
    frees_not_deferred(monkeypatch)
    options = ["--block-size", "2", "--kv-connector", "pd", "--async-scheduling", "--transfer-delay", "1"]
    trace = found_and_replayed(capsys, tmp_path / "corpus", options, {Check.DELAYED_FREE}, "vLLM defers its free")
    assert trace.setup.kv_connector == "pd" and trace.setup.async_scheduling
    # the reproducer plays vLLM's offloading connector only, and says so of a trace it would otherwise play (one
    # failing a check it states, synchronous: the leak of a sent request's blocks is such a one)
    leak = attrs.evolve(
        trace,
        setup=attrs.evolve(trace.setup, async_scheduling=False),
        failure=attrs.evolve(trace.failure, check=Check.ACCOUNTING.value),
    )
    with pytest.raises(NotReproducible, match="P/D connector is not played by the reproducer"):
        check_reproducible(leak)


def test_the_connector_is_refused_with_a_hybrid_model() -> None:
    with pytest.raises(ValueError, match="the P/D connector is driven only with the full-attention model"):
        attrs.evolve(SYNC, model="sliding-window")


def test_a_request_the_connector_skipped_without_blocks_is_served_in_the_waiting_queue_s_order() -> None:
    """The order oracle's false alarm of the first pinned campaign (shrunk to 39 operations, then the drain): a
    request vLLM skipped for the LoRA limit sits in ``deferred_waiting`` with no blocks, and is later admitted from
    the waiting queue behind a preempted request; the oracle took it for one served ahead from the connector's queue
    and named a correct FCFS victim. It replays clean now (it reproduced before the fix)."""
    trace = load(Path(__file__).parent / "data" / "order-deferred-waiting-served-in-order.json")
    replayed = replay(trace)
    assert replayed.failure is None, replayed.describe_failure()


def test_a_failed_load_s_seeded_bug_is_found_by_a_run_and_its_trace_replays(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvfuzz run --kv-connector pd --load-failures`` finds the requests a failed load left counted as computed,
    its message names the failed load, and its trace (with ``load_failures``) replays."""
    invalid_blocks_kept_computed(monkeypatch)
    options = ["--block-size", "2", "--kv-connector", "pd", "--load-failures", "--transfer-delay", "1"]
    trace = found_and_replayed(capsys, tmp_path / "corpus", options, {Check.CONTENT}, "load failed before this block")
    assert trace.setup.kv_connector == "pd" and trace.setup.load_failures
