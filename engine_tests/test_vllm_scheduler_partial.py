"""Partial prefix caching (docs/scheduler-features.md#partial-prefix-caching): a Mamba hybrid whose prefix hashes are
finer than its blocks (``prefix_match_unit``), so vLLM caches a partial entry for the prompt's last hash boundary
inside a block and serves hits that end there through a copy-on-write block copy, which kvfuzz's worker runs
(kvfuzz/scheduler/partial_prefix.py). The unmodified scheduler passes with partial hits served; each seeded bug is
caught, from hand-written requests with its message, and from random requests with the trace that replays it.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there): without vLLM the import fails
loudly rather than skipping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core import block_pool, kv_cache_manager
from vllm.v1.core.sched import scheduler as scheduler_module

from engine_tests.vllm_seeded_runs import found_and_replayed, run_until_finished
from kvfuzz.scheduler import worker as worker_module
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.violations import Check, SchedulerViolation

PARTIAL = SchedulerSetup(model="mamba-hybrid", prefix_match_unit=2)  # 16 blocks of 4, hashes every 2 tokens
PROMPT = [1, 2, 3, 0, 2, 2, 1, 3, 0, 1, 2, 3]  # its last hash boundary below its last token: 10, inside block 2
SHARER = PROMPT[:10] + [3, 3]  # shares those 10 tokens: a partial hit of 10


def dropped_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the scheduler output carries no block copies (the copy-on-write blocks stay as the pool left
    them)."""
    original = scheduler_module.Scheduler.schedule

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        output.kv_cache_block_copies = None
        return output

    monkeypatch.setattr(scheduler_module.Scheduler, "schedule", schedule)


def reversed_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: each block copy runs the wrong way, from the fresh block into the cached one it should copy."""
    original = kv_cache_manager.KVCacheManager.take_kv_cache_block_copies

    def take(self: Any) -> Any:
        copies, retained = original(self)
        return [type(copy)(copy.dst_block_id, copy.src_block_id) for copy in copies], retained

    monkeypatch.setattr(kv_cache_manager.KVCacheManager, "take_kv_cache_block_copies", take)


def overlong_partial_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a partial entry is keyed by the hash one hash block past the prefix its block holds (where the
    request has one), so a hit on it claims tokens the block's K/V and state do not cover."""

    def partial_hash(self: Any, request: Any, num_tokens: int) -> Any:
        index = num_tokens // self.hash_block_size
        return request.block_hashes[min(index, len(request.block_hashes) - 1)]

    monkeypatch.setattr(block_pool.BlockPool, "_get_partial_block_hash", partial_hash)


def hits_past_the_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a hit that ends inside a block is reported one token longer than the entry it found."""
    original = kv_cache_manager.KVCacheManager.get_computed_blocks

    def computed(self: Any, request: Any, *args: Any) -> Any:
        blocks, hit, *rest = original(self, request, *args)
        if hit % self.coordinator.single_type_managers[0].block_size and hit + 1 < request.num_tokens:
            hit += 1
        return (blocks, hit, *rest)

    monkeypatch.setattr(kv_cache_manager.KVCacheManager, "get_computed_blocks", computed)


def unannounced_partial_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the block pool caches partial entries without a BlockStored event."""
    original = block_pool.BlockPool.cache_partial_block

    def cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        events, self.enable_kv_cache_events = self.enable_kv_cache_events, False
        try:
            return original(self, *args, **kwargs)
        finally:
            self.enable_kv_cache_events = events

    monkeypatch.setattr(block_pool.BlockPool, "cache_partial_block", cache)


def counted_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The block copies the worker runs, one entry per step that has any (its count)."""
    counts: list[int] = []
    original = worker_module.copy_blocks

    def copy(*args: Any) -> int:
        counts.append(original(*args))
        return counts[-1]

    monkeypatch.setattr(worker_module, "copy_blocks", copy)
    return counts


def shared_partial_prefix(setup: SchedulerSetup = PARTIAL) -> Session:
    """A session after PROMPT ran to its end and SHARER was admitted with the partial hit on its 10 tokens."""
    session = Session(setup)
    run_until_finished(session, session.add(PROMPT, 3))
    session.add(SHARER, 3)
    session.step()
    return session


def test_vllm_turns_partial_hits_on_and_the_scheduler_splits_at_the_hash_block() -> None:
    scheduler = Session(PARTIAL).scheduler
    assert scheduler.kv_cache_manager.coordinator.enable_partial_hash_hits
    assert (scheduler.block_size, scheduler.hash_block_size, scheduler.mamba_partial_cache_hit) == (4, 2, True)
    plain = Session(SchedulerSetup(model="mamba-hybrid")).scheduler
    assert not plain.kv_cache_manager.coordinator.enable_partial_hash_hits and plain.hash_block_size == 4


def test_a_partial_hit_is_served_through_a_block_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sharer gets its 10 tokens from the cache (two full blocks and the partial entry inside the third): its
    attention block and Mamba state block are copies of the producer's, and it finishes with every check passing."""
    counts = counted_copies(monkeypatch)
    session = shared_partial_prefix(SchedulerSetup(model="mamba-hybrid", prefix_match_unit=2, kv_events=True))
    assert session.hit_tokens == 10
    assert counts and counts[-1] == 2  # one copy per group: the attention block and the Mamba state
    session.drain()
    assert session.events.events > 0


def test_the_unmodified_scheduler_passes_with_partial_hits_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = counted_copies(monkeypatch)
    for setup in (
        SchedulerSetup(model="mamba-hybrid", prefix_match_unit=1, kv_events=True, max_num_batched_tokens=6),
        SchedulerSetup(model="mamba-hybrid", block_size=8, prefix_match_unit=2, async_scheduling=True),
    ):
        outcome = search(setup, examples=25, steps=30)
        assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
        assert outcome.hit_tokens > 0, outcome.describe()
    assert sum(counts) > 0


def test_a_partial_hit_without_its_block_copy_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    dropped_copies(monkeypatch)
    with pytest.raises(SchedulerViolation) as caught:
        shared_partial_prefix()
    violation = caught.value
    assert (violation.check, violation.request) == (Check.CONTENT, "r1"), violation
    assert violation.cause in {"a cache hit on unwritten content", "a cache hit on other content"}, violation


def test_a_block_copy_into_the_cached_block_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer's own copy (its Mamba state at the partial tail moved out of the block its next step overwrites)
    runs backwards, into the state block it still holds."""
    reversed_copies(monkeypatch)
    session = Session(PARTIAL)
    with pytest.raises(SchedulerViolation) as caught:
        run_until_finished(session, session.add(PROMPT, 8))
    assert str(caught.value) == (
        "exclusive check failed at step 3, request r0: the step copies block 6 into block 4 (a copy-on-write of a "
        "partial prefix-cache hit), but request r0 still holds block 4: the copy overwrites what it relies on"
    )
    assert caught.value.cause == "a block copy over a held block"


def test_a_partial_entry_keyed_past_its_prefix_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry of PROMPT's boundary 10 is keyed by the hash of its 12 tokens: a request of PROMPT and more hits
    12 tokens, and the copied state is the one after 10."""
    overlong_partial_entries(monkeypatch)
    session = Session(PARTIAL)
    run_until_finished(session, session.add(PROMPT, 3))
    with pytest.raises(SchedulerViolation) as caught:
        run_until_finished(session, session.add(PROMPT + [0, 0, 1], 3))
    violation = caught.value
    assert (violation.check, violation.request) == (Check.CONTENT, "r1"), violation
    assert violation.cause == "a Mamba state not the request's own", violation
    assert (
        "it resumes from 12 computed tokens, so its state block 6 in Mamba group 0 should hold a checkpoint of its "
        "prefix after them" in str(violation)
    ), violation
    assert "but holds the state of request r0 after 10 tokens" in str(violation), violation


def test_a_hit_past_the_partial_entry_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    hits_past_the_entry(monkeypatch)
    with pytest.raises(SchedulerViolation) as caught:
        shared_partial_prefix()
    assert str(caught.value) == (
        "prefix-hit check failed at step 6, request r1: it is scheduled with 11 tokens from the prefix cache, which "
        "is not a multiple of the 2-token prefix hash: a hit ends where a cached hash ends"
    )


def test_an_unannounced_partial_entry_is_caught_by_the_kv_events_check(monkeypatch: pytest.MonkeyPatch) -> None:
    unannounced_partial_entries(monkeypatch)
    session = Session(SchedulerSetup(model="mamba-hybrid", prefix_match_unit=2, kv_events=True))
    with pytest.raises(SchedulerViolation) as caught:
        run_until_finished(session, session.add(PROMPT, 3))
    violation = caught.value
    assert violation.check == Check.KV_EVENTS, violation
    assert "a block was cached without a BlockStored" in str(violation), violation


def test_a_partial_match_unit_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfuzz.cli import main

    assert main(["run", "--scheduler", "vllm-v1", "--prefix-match-unit", "2"]) == 2
    assert "needs model mamba-hybrid with prefix caching" in capsys.readouterr().err
    assert main(["run", "--scheduler", "vllm-v1", "--model", "mamba-hybrid", "--prefix-match-unit", "3"]) == 2
    assert "prefix_match_unit must divide block_size 4 and be smaller, got 3" in capsys.readouterr().err


@pytest.mark.parametrize(
    "bug, options, checks, named",
    [
        (dropped_copies, [], {Check.CONTENT}, "should hold"),
        (reversed_copies, [], {Check.EXCLUSIVE}, "the copy overwrites what it relies on"),
        (overlong_partial_entries, [], {Check.CONTENT}, "should hold"),
        (hits_past_the_entry, [], {Check.PREFIX_HIT}, "not a multiple of the 2-token prefix hash"),
        (unannounced_partial_entries, ["--kv-events"], {Check.KV_EVENTS}, "BlockStored"),
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
    options = ["--model", "mamba-hybrid", "--prefix-match-unit", "2", *options]
    trace = found_and_replayed(capsys, tmp_path / "corpus", options, checks, named)
    assert trace.setup.prefix_match_unit == 2
    monkeypatch.undo()
