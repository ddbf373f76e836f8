"""Requests that skip reading the prefix cache (kvfuzz/scheduler/prefix_reads.py, docs/scheduler-features.md): vLLM's
``skip_reading_prefix_cache``, drawn for a quarter of the requests. The unmodified scheduler passes with them drawn,
a skipping request gets no hit where the others do, and a seeded bug (the local lookup ignoring the flag) is caught
by the prefix-hit check, by hand and from random requests, whose trace replays.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.request import Request

from engine_tests.vllm_seeded_runs import found_and_replayed, run_until_finished
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.prefix_reads import skips_reads
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.violations import Check, SchedulerViolation

SKIPPING = SchedulerSetup(num_blocks=8, skip_prefix_reads=True)
PREFIX = [1, 2, 3, 0, 2, 2, 1, 3]  # two full blocks of 4


def reads_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the local prefix-cache lookup ignores a request's skip_reading_prefix_cache (vLLM 0.33.0 reads the
    flag in ``prefix_cache_lookup_enabled``; 0.34.0 turns it into the request's ``prefix_cache_hit_limit`` of 0, which
    bounds every lookup)."""
    if hasattr(Request, "get_prefix_cache_hit_limit"):
        monkeypatch.setattr(Request, "get_prefix_cache_hit_limit", lambda self: None)
    else:
        monkeypatch.setattr(KVCacheManager, "prefix_cache_lookup_enabled", lambda self, request: self.enable_caching)


def test_the_unmodified_scheduler_passes_with_requests_skipping_prefix_reads() -> None:
    outcome = search(SKIPPING, examples=25, steps=30)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.hit_tokens > 0, outcome.describe()  # the others still hit


def test_a_request_that_skips_prefix_reads_gets_no_hit_where_the_others_do() -> None:
    """Seven equal prompts one after the other: r5 skips reading (kvfuzz's draw, from its id); every other request
    after r0 hits the two cached blocks, r5 none, and vLLM's request carries the flag."""
    session = Session(attrs.evolve(SKIPPING, num_blocks=16))
    hits = []
    for _ in range(7):
        before = session.hit_tokens
        request = session.add(PREFIX + [0], 1)
        skips = session.scheduler.requests[request].sampling_params.skip_reading_prefix_cache
        assert skips is skips_reads(SKIPPING, request), (request, skips)
        run_until_finished(session, request)
        hits.append(session.hit_tokens - before)
    assert [skips_reads(SKIPPING, f"r{index}") for index in range(7)] == [False] * 5 + [True, False]
    assert hits == [0, 8, 8, 8, 8, 0, 8]
    session.drain()


def test_a_lookup_ignoring_the_skip_is_caught_by_the_prefix_hit_check(monkeypatch: pytest.MonkeyPatch) -> None:
    reads_ignored(monkeypatch)
    session = Session(attrs.evolve(SKIPPING, num_blocks=16))
    with pytest.raises(SchedulerViolation) as caught:
        for _ in range(6):
            run_until_finished(session, session.add(PREFIX + [0], 1))
    violation = caught.value
    assert (violation.check, violation.request, violation.cause) == (
        Check.PREFIX_HIT,
        "r5",
        "a hit for a request that skips prefix-cache reads",
    ), violation
    assert str(violation) == documented_message(), "docs/scheduler-features.md quotes another message"


def documented_message() -> str:
    """The message docs/scheduler-features.md quotes for this seeded bug, its lines joined."""
    page = (Path(__file__).parents[1] / "docs" / "scheduler-features.md").read_text()
    section = page.split("## Requests that skip prefix-cache reads", 1)[1]
    block = section.split("```text\n", 1)[1].split("\n```", 1)[0]
    return " ".join(block.splitlines())


def test_the_seeded_bug_is_found_from_random_requests_and_its_trace_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    reads_ignored(monkeypatch)
    trace = found_and_replayed(
        capsys, tmp_path / "corpus", ["--skip-prefix-reads"], {Check.PREFIX_HIT}, "skips reading the prefix cache"
    )
    assert trace.setup.skip_prefix_reads
    monkeypatch.undo()


def test_the_stats_check_counts_no_lookup_for_a_request_that_skips_prefix_reads() -> None:
    """vLLM's prefix-cache stats do not count a request that skipped the lookup: the stats check expected it counted
    and failed on the unmodified scheduler (a campaign's false report, 'stats: prefix-cache lookups')."""
    session = Session(attrs.evolve(SKIPPING, num_blocks=16, stats=True))
    for _ in range(7):  # r5 skips
        run_until_finished(session, session.add(PREFIX + [0], 1))
    session.drain()
