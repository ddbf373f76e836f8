"""Engine features the scheduler target drives beyond requests and steps (docs/scheduler-features.md): the client's
prefix-cache resets (kvfuzz/scheduler/prefix_reset.py), vLLM's KV cache events checked against the block pool
(kvfuzz/scheduler/kv_events.py), and requests that run into max_model_len with their finish reason
(kvfuzz/scheduler/model_length.py). The unmodified scheduler passes with all three drawn; each seeded bug is caught,
from hand-written requests with its message, and from random requests with the trace that replays it.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there): without vLLM the import fails
loudly rather than skipping."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
from vllm.v1.core import block_pool
from vllm.v1.core.sched import scheduler as scheduler_module
from vllm.v1.request import RequestStatus

from engine_tests.vllm_seeded_runs import found_and_replayed, run_until_finished
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.program import ResetPrefixCache
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.violations import Check, SchedulerViolation

FEATURES = SchedulerSetup(num_blocks=8, prefix_resets=True, kv_events=True, overlong_requests=True)
PREFIX = [1, 2, 3, 0, 2, 2, 1, 3]  # two full blocks of 4


def reset_while_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the block pool resets the prefix cache whatever blocks are in use (its check of the free count is
    gone)."""
    original = block_pool.BlockPool.reset_prefix_cache

    def reset(self: Any) -> bool:
        free = self.get_num_free_blocks
        self.get_num_free_blocks = lambda: self.num_gpu_blocks - 1
        try:
            return bool(original(self))
        finally:
            self.get_num_free_blocks = free

    monkeypatch.setattr(block_pool.BlockPool, "reset_prefix_cache", reset)


def reset_keeps_the_hash_map(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the block pool's reset clears the blocks' hashes but keeps the hash -> block map, so a later
    request hits blocks computed before the reset."""
    original = block_pool.BlockPool.reset_prefix_cache

    def reset(self: Any) -> bool:
        kept = [(block.block_hash, block) for block in self.blocks if block.block_hash is not None]
        done = bool(original(self))
        if done:  # the map's entries put back (vLLM 0.33.0 replaces the map, 0.34.0 clears it)
            for key, block in kept:
                self.cached_block_hash_to_block.insert(key, block)
        return done

    monkeypatch.setattr(block_pool.BlockPool, "reset_prefix_cache", reset)


def unannounced_removals(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the block pool evicts cached blocks without a BlockRemoved event."""
    monkeypatch.setattr(block_pool.BlockPool, "_emit_block_removed_events", lambda self, hashes: None)


def parentless_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: every BlockStored event is announced without its parent hash, as if each run of newly cached
    blocks started the request."""
    original = block_pool.BlockPool._build_block_stored_event

    def build(self: Any, request: Any, block_hashes: Any, parent_block_hash: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, request, block_hashes, None, *args, **kwargs)

    monkeypatch.setattr(block_pool.BlockPool, "_build_block_stored_event", build)


def _patch_check_stop(monkeypatch: pytest.MonkeyPatch, patched: Callable[..., bool]) -> None:
    monkeypatch.setattr(scheduler_module, "check_stop", patched)


def no_model_length_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the scheduler's stop check is not given the model length, so a request grows past it."""
    original = scheduler_module.check_stop
    _patch_check_stop(monkeypatch, lambda request, max_model_len: original(request, 1 << 30))


def model_length_reported_as_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a request stopped at the model length is marked stopped (finish reason ``stop``), not capped."""
    original = scheduler_module.check_stop

    def check_stop(request: Any, max_model_len: int) -> bool:
        stopped = bool(original(request, max_model_len))
        if request.status == RequestStatus.FINISHED_LENGTH_CAPPED and request.num_tokens >= max_model_len:
            request.status = RequestStatus.FINISHED_STOPPED
        return stopped

    _patch_check_stop(monkeypatch, check_stop)


def test_the_unmodified_scheduler_passes_with_resets_events_and_overlong_requests_drawn() -> None:
    outcome = search(FEATURES, examples=25, steps=30)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0 and outcome.hit_tokens > 0, outcome.describe()


def test_a_reset_refuses_while_blocks_are_in_use_and_no_hit_crosses_it() -> None:
    """A reset while a request runs is refused; once idle it succeeds, and the same prompt then hits nothing (it did
    before the reset); with ``preempt`` it succeeds while requests run, and they finish."""
    session = Session(SchedulerSetup(prefix_resets=True, kv_events=True))
    run_until_finished(session, session.add(PREFIX + [0], 1))
    before = session.hit_tokens
    running = session.add(PREFIX + [1], 4)
    session.step()
    assert session.hit_tokens - before == 8  # a hit before any reset
    assert session.reset_prefix_cache() is False and session.resets.refused == 1
    run_until_finished(session, running)
    session.step()  # the scheduler tells the worker of the finish
    assert session.reset_prefix_cache() is True and session.resets.epoch == 1
    before = session.hit_tokens
    again = session.add(PREFIX + [2], 4)
    session.step()
    assert session.hit_tokens == before  # nothing cached before the reset is served
    assert session.reset_prefix_cache(preempt=True) is True and session.resets.epoch == 2
    run_until_finished(session, again)
    session.drain()
    assert ResetPrefixCache(True) in session.program and session.events.events > 0


def test_a_request_past_max_model_len_finishes_there_with_reason_length() -> None:
    session = Session(SchedulerSetup(overlong_requests=True))
    request = session.add([0, 1, 2], 1000)
    run_until_finished(session, request)
    assert len(session.outputs.requests[request].received) == session.setup.max_model_len - 3
    session.drain()


def test_a_reset_while_blocks_are_in_use_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    reset_while_in_use(monkeypatch)
    session = Session(SchedulerSetup(prefix_resets=True))
    session.add(PREFIX + [0], 4)
    session.step()
    with pytest.raises(SchedulerViolation) as caught:
        session.reset_prefix_cache()
    assert str(caught.value) == (
        "prefix-reset check failed at step 1: reset_prefix_cache() succeeded while block(s) [1, 2, 3] were in use: "
        "it must refuse until they are freed"
    )


def test_a_reset_that_keeps_the_hash_map_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    reset_keeps_the_hash_map(monkeypatch)
    session = Session(SchedulerSetup(prefix_resets=True))
    run_until_finished(session, session.add(PREFIX + [0], 1))
    session.step()
    with pytest.raises(SchedulerViolation) as caught:
        session.reset_prefix_cache()
    assert caught.value.check == Check.PREFIX_RESET and caught.value.cause == "blocks still cached after a reset"
    assert "the cache maps 2 hash(es): a later request could hit K/V from before it" in str(caught.value)


def test_an_unannounced_eviction_is_caught_by_the_kv_events_check(monkeypatch: pytest.MonkeyPatch) -> None:
    unannounced_removals(monkeypatch)
    session = Session(SchedulerSetup(num_blocks=3, kv_events=True))
    run_until_finished(session, session.add(PREFIX + [0], 1))  # two blocks cached
    with pytest.raises(SchedulerViolation) as caught:
        run_until_finished(session, session.add([3, 3, 3, 3, 3, 3, 3, 3, 3], 1))  # evicts them
    violation = caught.value
    assert violation.check == Check.KV_EVENTS, violation
    assert "the KV cache events leave 1 block(s) holding hash" in str(violation), violation
    assert "but the pool caches it in 0 block(s) []" in str(violation), violation


def test_a_stored_run_without_its_parent_is_caught_by_the_kv_events_check(monkeypatch: pytest.MonkeyPatch) -> None:
    parentless_runs(monkeypatch)
    session = Session(SchedulerSetup(kv_events=True, max_num_batched_tokens=4))
    with pytest.raises(SchedulerViolation) as caught:
        run_until_finished(session, session.add(PREFIX + [0], 1))  # its second block is cached a step after the first
    violation = caught.value
    assert (violation.check, violation.cause) == (Check.KV_EVENTS, "a wrong block hash"), violation
    assert (
        "(parent null, tokens [2, 2, 1, 3]), but it is the hash of the 8-token prefix [1, 2, 3, 0, 2, 2, 1, 3]"
        in str(violation)
    ), violation


def test_a_request_growing_past_max_model_len_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The request fills the pool (its whole model length) and waits for a block that never comes: the drain's
    progress check names it."""
    no_model_length_stop(monkeypatch)
    session = Session(SchedulerSetup(num_blocks=4, overlong_requests=True))
    session.add([0, 1, 2], 100)
    with pytest.raises(SchedulerViolation) as caught:
        session.drain()
    assert caught.value.check == Check.PROGRESS, caught.value
    assert "r0 (RUNNING, 15 computed, 13 of 13 output tokens)" in str(caught.value), caught.value


def test_a_model_length_stop_reported_as_stop_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    model_length_reported_as_stop(monkeypatch)
    session = Session(SchedulerSetup(num_blocks=4, overlong_requests=True))
    with pytest.raises(SchedulerViolation) as caught:
        run_until_finished(session, session.add([0, 1, 2], 100))
    assert str(caught.value).startswith("outputs check failed at step "), caught.value
    assert "finished with reason 'stop', but its max_tokens is 13" in str(caught.value), caught.value
    assert caught.value.cause == "a wrong finish reason"


@pytest.mark.parametrize(
    "bug, options, checks, named",
    [
        (reset_while_in_use, ["--prefix-resets"], {Check.PREFIX_RESET}, "were in use"),
        # stale hits are caught at the reset (the map left behind), or where a request attends to one
        (reset_keeps_the_hash_map, ["--prefix-resets"], {Check.PREFIX_RESET, Check.CONTENT}, "before"),
        (unannounced_removals, ["--kv-events"], {Check.KV_EVENTS}, "BlockRemoved"),
        (parentless_runs, ["--kv-events"], {Check.KV_EVENTS}, "(parent null"),
        (no_model_length_stop, ["--overlong-requests"], {Check.PROGRESS, Check.OUTPUTS}, "unfinished"),
        (model_length_reported_as_stop, ["--overlong-requests"], {Check.OUTPUTS}, "finished with reason 'stop'"),
    ],
)
def test_each_seeded_bug_is_found_from_random_requests_and_its_trace_replays(
    bug: Any,
    options: list[str],
    checks: set[Check],
    named: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bug(monkeypatch)
    found_and_replayed(capsys, tmp_path / "corpus", options, checks, named)
    monkeypatch.undo()
