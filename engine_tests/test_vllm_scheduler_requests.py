"""Cache salts and stop tokens in the scheduler target (kvfuzz/scheduler/requests.py, docs/scheduler-requests.md): the
unmodified scheduler passes with both drawn, each reaches vLLM, and each is shown catching a seeded bug (vLLM's
block hashing ignoring the salt: content; the scheduler not stopping on a stop token: outputs), from hand-written
requests with the message, and from random requests with the trace that replays it.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there): without vLLM 0.33.0 the import
fails loudly rather than skipping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core import kv_cache_utils

from engine_tests.vllm_seeded_runs import found_and_replayed, run_until_finished
from engine_tests.vllm_stop_seeds import check_stop_seeing
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.violations import Check, SchedulerViolation

BOTH = SchedulerSetup(num_blocks=8, cache_salts=True, stop_tokens=True)  # small enough to preempt
PREFIX = [1, 2, 3, 0, 2, 2, 1, 3]  # two full blocks of 4
R0_OUTPUT = [0, 1, 3, 0, 3, 1, 2, 0]  # the fake model's first 8 tokens for r0 after an 8-token prompt


def ignore_salt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: vLLM's block hashing leaves the cache salt out of the first block's extra keys, so the prefix
    cache shares blocks across salts."""
    original = kv_cache_utils.generate_block_hash_extra_keys

    def without_salt(request: Any, start: int, end: int, mm_index: int) -> Any:
        salt, request.cache_salt = request.cache_salt, None
        try:
            return original(request, start, end, mm_index)
        finally:
            request.cache_salt = salt

    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", without_salt)


def ignore_stop_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the scheduler's stop check ignores stop token ids (requests run to max_tokens)."""
    check_stop_seeing(monkeypatch, "stop_token_ids", [])


def test_the_unmodified_scheduler_passes_with_salts_and_stop_tokens_drawn() -> None:
    outcome = search(BOTH, examples=25, steps=30)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0 and outcome.hit_tokens > 0, outcome.describe()


def test_a_salt_reaches_vllm_s_prefix_cache() -> None:
    """Equal prompts: a hit under the same salt (and between unsalted requests), none across salts or between a
    salted and an unsalted one."""
    session = Session(SchedulerSetup())
    hits = []
    for salt in ("a", "a", "b", None, None):
        before = session.hit_tokens
        run_until_finished(session, session.add(PREFIX + [0], 1, cache_salt=salt))
        hits.append(session.hit_tokens - before)
    assert hits == [0, 8, 0, 0, 8]
    session.drain()


def test_a_stop_token_ends_the_request_with_it_included_and_frees_its_blocks() -> None:
    session = Session(SchedulerSetup())
    request = session.add(PREFIX, 8, stop_token_ids=(3,))
    run_until_finished(session, request)
    assert session.outputs.requests[request].received == R0_OUTPUT[:3]  # up to the first 3, included
    assert session.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 16  # blocks freed
    session.drain()  # the accounting check, quiescent: no table held, every block free


def test_a_salt_ignored_by_block_hashing_is_caught_by_the_content_check(monkeypatch: pytest.MonkeyPatch) -> None:
    ignore_salt(monkeypatch)
    session = Session(SchedulerSetup())
    run_until_finished(session, session.add(PREFIX + [0], 1, cache_salt="a"))
    with pytest.raises(SchedulerViolation) as caught:
        run_until_finished(session, session.add(PREFIX + [0], 1, cache_salt="b"))
    violation = caught.value
    assert (violation.check, violation.request) == (Check.CONTENT, "r1"), violation
    assert str(violation).startswith(
        "content check failed at step 2, request r1: position 0 (block 1, slot 4) should hold the K/V of the "
        "request's own tokens [1] under cache salt 'b' (tag "
    ), violation
    assert "but holds the K/V of request r0's position 0 under cache salt 'a'" in str(violation), violation


def test_the_scheduler_not_stopping_is_caught_by_the_outputs_check(monkeypatch: pytest.MonkeyPatch) -> None:
    ignore_stop_tokens(monkeypatch)
    session = Session(SchedulerSetup())
    request = session.add(PREFIX, 8, stop_token_ids=(3,))
    with pytest.raises(SchedulerViolation) as caught:
        run_until_finished(session, request)
    assert str(caught.value) == (
        "outputs check failed at step 4, request r0: 4 output tokens [0, 1, 3, 0] reported, but it should have "
        "finished with 3: its output #2, 3, is its first stop token (stop_token_ids [3]) (expected [0, 1, 3])"
    )


@pytest.mark.parametrize(
    "bug, checks, named",
    [
        # a block shared across salts is caught by whichever sees it first: a request relying on another salt's
        # K/V (content), or two requests of different salts sharing a block one of them writes (exclusive writes)
        (ignore_salt, {Check.CONTENT, Check.EXCLUSIVE}, "under cache salt"),
        (ignore_stop_tokens, {Check.OUTPUTS}, "is its first stop token"),
    ],
)
def test_each_seeded_bug_is_found_from_random_requests_and_its_trace_replays(
    bug: Any,
    checks: set[Check],
    named: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bug(monkeypatch)
    trace = found_and_replayed(capsys, tmp_path / "corpus", ["--cache-salts", "--stop-tokens"], checks, named)
    assert trace.setup.cache_salts and trace.setup.stop_tokens
    monkeypatch.undo()
    assert replay(trace).failure is None  # passes without the bug
