"""Full KV cache event reports (``kv_events_full``, docs/scheduler-features.md#full-reports): requests that ask for
``kv_cache_report_mode="full"`` have the cached blocks a prefix-cache lookup reuses announced too, and the ledger
(kvfuzz/scheduler/kv_events.py) holds every lookup to it. The unmodified scheduler passes on each model with
re-announcements reached; each bug seeded into vLLM is caught by the kv-events check.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import attrs
import pytest
from vllm.v1.core import block_pool, kv_cache_coordinator

from engine_tests.vllm_seeded_runs import found_and_replayed
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.kv_events import EventLedger, full_reports
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.trace import load
from kvfuzz.scheduler.violations import Check, SchedulerViolation

REPORTS = SchedulerSetup(num_blocks=12, block_size=2, kv_events=True, kv_events_full=True)
PROMPT = [1, 2, 3, 0, 2, 2, 1, 3, 0]


def run_examples(setup: SchedulerSetup, examples: int) -> int:
    """Random request programs with shared prefixes, each drained; the re-announcements the ledger checked."""
    reannounced = 0
    for example in range(examples):
        rng = random.Random(example)
        session = Session(setup)
        for _ in range(30):
            if rng.random() < 0.4:
                session.add(PROMPT[: rng.randint(1, len(PROMPT))], rng.randint(1, 3))
            else:
                session.step()
        session.drain()
        assert isinstance(session.events, EventLedger)
        reannounced += session.events.reannounced
    return reannounced


def first_failure(setup: SchedulerSetup = REPORTS, examples: int = 30) -> SchedulerViolation:
    with pytest.raises(SchedulerViolation) as raised:
        run_examples(setup, examples)
    return raised.value


def full_request(session: Session, prompt: list[int], full: bool) -> str:
    """Add ``prompt`` as the next request whose id asks for full reports (``full``) or not, adding one-token
    fillers (each run to its end) until the next id draws that way."""
    while full_reports(session.setup, f"r{len(session.lengths)}") != full:
        filler = session.add([3], 1)
        while not session.outputs.requests[filler].finished:
            session.step()
    return session.add(prompt, 1)


@pytest.mark.parametrize(
    "setup",
    [
        REPORTS,
        SchedulerSetup(num_blocks=24, block_size=2, model="sliding-window", kv_events=True, kv_events_full=True),
        SchedulerSetup(num_blocks=24, block_size=2, model="mamba-hybrid", kv_events=True, kv_events_full=True),
    ],
    ids=["full", "sliding-window", "mamba-hybrid"],
)
def test_the_unmodified_scheduler_passes_with_full_reports_reached(setup: SchedulerSetup) -> None:
    assert run_examples(setup, 8) > 0


def test_half_the_requests_ask_for_full_reports_and_only_with_the_switch() -> None:
    asking = [full_reports(REPORTS, f"r{index}") for index in range(200)]
    assert 70 < sum(asking) < 130
    assert not any(full_reports(SchedulerSetup(kv_events=True), f"r{index}") for index in range(200))
    with pytest.raises(ValueError, match="need the KV cache events"):
        SchedulerSetup(kv_events_full=True)


def test_a_hit_of_a_request_asking_for_full_reports_is_announced_again_counts_unchanged() -> None:
    session = Session(REPORTS)
    first = full_request(session, PROMPT, False)
    while not session.outputs.requests[first].finished:
        session.step()
    before = session.events.announced.copy()
    full_request(session, PROMPT, True)  # hits the first request's four cached blocks
    session.step()
    assert session.events.reannounced == 1 and session.events.announced == before


# -- bugs seeded into vLLM ------------------------------------------------------------------------------------------


def reports_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a request asking for full reports has its reused blocks announced never."""
    monkeypatch.setattr(kv_cache_coordinator.KVCacheCoordinator, "emit_cached_block_events", lambda *args: None)


def whole_prompt_announced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a full report announces every full block of the prompt, not only those the lookup hit."""
    original = block_pool.BlockPool.emit_cached_block_events

    def emit(self: Any, request: Any, num_cached_blocks: int, block_size: int, group: int) -> None:
        original(self, request, max(num_cached_blocks, len(request.prompt_token_ids) // block_size), block_size, group)

    monkeypatch.setattr(block_pool.BlockPool, "emit_cached_block_events", emit)


def reported_for_everyone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the reused blocks of every request are announced, whatever report mode it asked for."""
    original = kv_cache_coordinator.KVCacheCoordinator.emit_cached_block_events

    def lookup(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        found = lookup.original(self, request, *args, **kwargs)
        if found[1] > 0 and getattr(request, "kv_cache_report_mode", "incremental") != "full":
            original(self.coordinator, request, found[0].blocks)
        return found

    from vllm.v1.core.kv_cache_manager import KVCacheManager

    lookup.original = KVCacheManager.get_computed_blocks  # type: ignore[attr-defined]
    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", lookup)


def report_mode_unread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the request does not read the report mode its client asked for (every request incremental)."""
    from vllm.v1.request import Request

    original = Request.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.kv_cache_report_mode = "incremental"

    monkeypatch.setattr(Request, "__init__", init)


def shifted_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a full report's tokens start one block late (its hashes name other prefixes)."""
    original = block_pool.BlockPool._build_block_stored_event

    def build(self: Any, request: Any, block_hashes: Any, parent_block_hash: Any, *args: Any, **kwargs: Any) -> Any:
        event = original(self, request, block_hashes, parent_block_hash, *args, **kwargs)
        if parent_block_hash is None and len(block_hashes) > 1:
            event.block_hashes = list(event.block_hashes[1:]) + [event.block_hashes[0]]
        return event

    monkeypatch.setattr(block_pool.BlockPool, "_build_block_stored_event", build)


@pytest.mark.parametrize(
    ("bug", "cause"),
    [
        (reports_ignored, "a reuse not announced"),
        (report_mode_unread, "a reuse not announced"),
        (whole_prompt_announced, "a reuse announced wrong"),
        (reported_for_everyone, "a reuse announced unasked"),
        (shifted_report, "a wrong block hash"),
    ],
    ids=["ignored", "mode-unread", "whole-prompt", "unasked", "shifted"],
)
def test_a_seeded_vllm_bug_is_caught(monkeypatch: pytest.MonkeyPatch, bug: Any, cause: str) -> None:
    bug(monkeypatch)
    failure = first_failure()
    assert (failure.check, failure.cause) == (Check.KV_EVENTS, cause), failure


def test_a_report_of_blocks_the_pool_never_cached_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole prompt announced where only its first two blocks are cached: the router would learn of two blocks
    the pool does not hold."""
    whole_prompt_announced(monkeypatch)
    session = Session(REPORTS)
    first = full_request(session, PROMPT[:5], False)  # caches two blocks
    while not session.outputs.requests[first].finished:
        session.step()
    full_request(session, PROMPT, True)
    with pytest.raises(SchedulerViolation) as caught:
        session.step()
    assert (caught.value.check, caught.value.cause) == (Check.KV_EVENTS, "a reuse of a block never stored")
    assert "as its block 2 (group 0)" in str(caught.value), caught.value


def test_a_seeded_bug_is_found_by_a_run_and_its_trace_replays(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvfuzz run --kv-events --kv-events-full`` finds the ignored full reports, and its trace replays."""
    reports_ignored(monkeypatch)
    options = ["--kv-events", "--kv-events-full"]
    trace = found_and_replayed(capsys, tmp_path / "corpus", options, {Check.KV_EVENTS}, "asked for full")
    assert trace.setup.kv_events_full


# -- a vLLM bug the full reports found --------------------------------------------------------------------------------

DATA = Path(__file__).parent / "data"
CORPUS = Path(__file__).parent.parent / "corpus"


@pytest.mark.parametrize(
    ("path", "found"),
    [
        (
            DATA / "full-reports-partial-hit-announced-whole.json",
            "kv-events check failed at step 2: a BlockStored event re-announcing a prefix-cache hit (a full report) "
            "names hash 0xc14655208bfcee11 as its block 1 (group 1), which the events hold no block of: the pool does "
            "not cache it",
        ),
        (
            CORPUS / "vllm-v1-scheduler-full-reports-partial-hit-crash-ed954bdbb683.json",  # a known-bug trace
            "crash: IndexError: list index out of range",
        ),
    ],
    ids=["announced-whole", "crash"],
)
def test_full_reports_of_a_hit_ending_inside_a_block_are_a_vllm_bug(path: Path, found: str) -> None:
    """A finding in vLLM 0.33.0 and 0.34.0 (docs/scheduler-features.md#full-reports): under partial prefix caching
    (the Mamba hybrid, ``prefix_match_unit``) a hit may end inside a block, and ``emit_cached_block_events`` counts
    that block as a whole cached one. A full report then announces the block's full-block hash, which the pool never
    cached (r0 = r1 = [0, 1, 2, 0] on blocks of 2, hashes every token: r1 hits 3 tokens), or, where the block runs
    past the request's last full block, indexes past its hashes and the scheduler raises IndexError (r0 = [0, 1, 2,
    0, 1, 2, 0, 1], r1 its first 7 tokens, on blocks of 4). Replayed word for word; the same programs pass without
    full reports, and without partial prefix caching."""
    trace = load(path)
    replayed = replay(trace)
    assert replayed.reproduced and replayed.identical, replayed.describe_failure()
    assert replayed.describe_failure() == found
    for control in ({"kv_events_full": False}, {"prefix_match_unit": 0}):
        clean = replay(attrs.evolve(trace, setup=attrs.evolve(trace.setup, **control)))
        assert not clean.failed, (control, clean.describe_failure())
