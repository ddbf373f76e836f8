"""Resumable requests (vLLM's streaming sessions) in the scheduler target (docs/scheduler-features.md,
kvfuzz/scheduler/sessions.py): a session pauses at its stop holding its blocks, the client's new input continues it
with its kept tokens (the turn's last output dropped) and the new ones, its block hashes follow. The unmodified
scheduler passes; each seeded bug is caught, from hand-written requests with its message, and from random requests
with the trace that replays it.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there): without vLLM the import fails
loudly rather than skipping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.request import Request, RequestStatus

from engine_tests.vllm_seeded_runs import found_and_replayed
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.program import Resume
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.trace import load, program_from_json
from kvfuzz.scheduler.violations import Check, SchedulerViolation

SESSIONS = SchedulerSetup(sessions=True)
PROMPT = [1, 2, 0]  # three tokens: with one output, the session's first block is full, its last token the output


def kept_last_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The update keeps the turn's last sampled token (never computed) before the new input."""
    original = Scheduler._update_request_as_session

    def update(self: Any, session: Any, update: Any) -> None:
        last = session._all_token_ids[-1]
        original(self, session, update)
        at = len(session._all_token_ids) - len(update.prompt_token_ids or ())
        session._all_token_ids.insert(at, last)
        session.prompt_token_ids.insert(at, last)
        session.num_prompt_tokens += 1

    monkeypatch.setattr(Scheduler, "_update_request_as_session", update)


def stale_block_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The update keeps the block hashes it had, the one over the dropped token included."""
    original = Scheduler._update_request_as_session

    def update(self: Any, session: Any, update: Any) -> None:
        stale = list(session.block_hashes)
        original(self, session, update)
        session.block_hashes[: len(stale)] = stale

    monkeypatch.setattr(Scheduler, "_update_request_as_session", update)


def paused_session_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A session paused at its stop gives its blocks back to the pool, though it keeps (and resumes from) them."""
    original = Scheduler._handle_stopped_request

    def handle(self: Any, request: Any) -> bool:
        finished = original(self, request)
        if not finished and request.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            self.kv_cache_manager.free(request)
        return finished

    monkeypatch.setattr(Scheduler, "_handle_stopped_request", handle)


def paused_session_scheduled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A session waiting for its client's next input is let through as ready, and scheduled."""
    original = Scheduler._handle_blocked_waiting_request

    def handle(self: Any, request: Any) -> bool:
        if request.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            self.num_waiting_for_streaming_input -= 1
            request.status = RequestStatus.WAITING
            return True
        return original(self, request)

    monkeypatch.setattr(Scheduler, "_handle_blocked_waiting_request", handle)


def every_turn_reported_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A session's turn is reported with finish reason ``stop`` whatever ended it."""
    original = Request.get_finished_reason

    def reason(self: Any) -> Any:
        found = original(self)
        return FinishReason.STOP if self.resumable and found is not None else found

    monkeypatch.setattr(Request, "get_finished_reason", reason)


def paused(session: Session, request: str) -> bool:
    return session.sessions.is_paused(request)


def run_until_paused(session: Session, request: str) -> None:
    for _ in range(50):
        if paused(session, request):
            return
        session.step()
    raise AssertionError(f"{request} never paused")


def test_a_session_pauses_holding_its_blocks_and_resumes_with_its_kept_tokens_and_new_input() -> None:
    session = Session(SESSIONS)
    request = session.add(PROMPT, 1, resumable=True)
    run_until_paused(session, request)
    held = session.scheduler.requests[request]
    output = session.outputs.requests[request].received
    assert held.status == RequestStatus.WAITING_FOR_STREAMING_REQ and len(output) == 1
    assert session.scheduler.kv_cache_manager.get_block_ids(request)[0]  # it keeps its blocks while paused
    session.step()
    assert session.scheduler.requests[request].num_computed_tokens == 3  # not scheduled while paused
    assert session.resume(request, [3, 3], 2) is True
    assert list(held.all_token_ids) == PROMPT + [3, 3]  # the turn's last output dropped, the new input appended
    run_until_paused(session, request)
    second = session.outputs.requests[request]
    assert len(second.received) == 2 and second.prompt_length == 5
    assert session.resume(request, [1], 1) is True
    assert session.resume(request, [2], 1) is True  # sent while it runs: queued for its next stop
    run_until_paused(session, request)
    assert list(held.all_token_ids)[:7] == PROMPT + [3, 3] + second.received[:1] + [1]
    session.drain()
    assert request not in session.scheduler.requests and Resume(request, [1], 1) in session.program
    assert session.resume(request, [1], 1) is False  # closed: nothing sent


def test_a_session_trace_reads_back_and_resume_is_refused_without_sessions() -> None:
    program = [{"op": "add", "prompt": PROMPT, "max_tokens": 1, "resumable": True}, {"op": "step"}]
    program += [{"op": "resume", "request": "r0", "prompt": [1], "max_tokens": 2}]
    read = program_from_json(program, SESSIONS)
    assert [operation.to_json() for operation in read] == program
    with pytest.raises(Exception, match="config does not have sessions"):
        program_from_json(program, SchedulerSetup())
    with pytest.raises(Exception, match="op is add, abort or step"):
        program_from_json(program[1:], SchedulerSetup())


CORPUS = Path(__file__).parent.parent / "corpus"
DEADLOCK = CORPUS / "vllm-v1-scheduler-sessions-holding-pool-deadlock-68ba1f36c223.json"


def test_sessions_holding_the_pool_while_they_wait_deadlock_the_scheduler_a_vllm_bug() -> None:
    """A finding in vLLM 0.33.0 and 0.34.0 (docs/findings.md): sessions whose next input has arrived wait in
    ``kv_holding_waiting`` with their earlier turns' blocks; holding the pool with nothing running, the head cannot
    allocate and vLLM preempts only running requests, so every later step schedules nothing. On the full-attention
    model (no skipped Mamba blocks), replayed word for word; the same program with a pool twice as large passes."""
    trace = load(DEADLOCK)
    assert trace.setup.model == "full"
    replayed = replay(trace)
    assert replayed.reproduced and replayed.identical, replayed.describe_failure()
    assert replayed.failure is not None and replayed.failure.check == "progress"
    larger = replay(attrs.evolve(trace, setup=attrs.evolve(trace.setup, num_blocks=2 * trace.setup.num_blocks)))
    assert not larger.failed, larger.describe_failure()
    held = [request for request in trace.program if isinstance(request, Resume)]
    assert held, "the deadlock is the sessions' own: the program resumes them"


RESUME_GATE = Path(__file__).parent / "data" / "mamba-session-resume-gate-hang.json"


def skipped_blocks_freed_before_the_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Mamba session resume gate hang's cause taken away: ``allocate_slots`` frees the blocks its groups skip
    (``remove_skipped_blocks``, which vLLM calls after the full-sequence gate) before the gate counts the free
    blocks."""
    allocate = KVCacheManager.allocate_slots

    def gated_after_the_skip(
        self: Any, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0, *args: Any, **kwargs: Any
    ) -> Any:
        if kwargs.get("full_sequence_must_fit"):
            computed = (
                request.num_computed_tokens + num_new_computed_tokens + kwargs.get("num_external_computed_tokens", 0)
            )
            self.coordinator.remove_skipped_blocks(
                request.request_id,
                max(0, computed - request.num_in_flight_tokens),
                num_prompt_tokens=request.num_prompt_tokens,
            )
        return allocate(self, request, num_new_tokens, num_new_computed_tokens, *args, **kwargs)

    monkeypatch.setattr(KVCacheManager, "allocate_slots", gated_after_the_skip)


def test_the_mamba_session_resume_gate_hang_replays_and_passes_without_its_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A vLLM bug met by a ten-minute campaign (docs/findings.md): a session resumed on a Mamba hybrid with prefix
    caching, holding the blocks of its earlier turns, is refused by the full-sequence admission gate at every step,
    which counts the Mamba block the session skips as held. It replays word for word; it passes on the full-attention
    model, and with the skipped blocks freed before the gate."""
    trace = load(RESUME_GATE)
    assert trace.known_bug and trace.known_bug.startswith("vLLM bug")
    replayed = replay(trace)
    assert replayed.reproduced and replayed.identical, replayed.describe_failure()
    full = replay(attrs.evolve(trace, setup=attrs.evolve(trace.setup, model="full")))
    assert not full.failed, full.describe_failure()
    skipped_blocks_freed_before_the_gate(monkeypatch)
    fixed = replay(trace)
    assert not fixed.failed, fixed.describe_failure()


def test_sessions_are_refused_where_the_client_cannot_follow_them() -> None:
    with pytest.raises(ValueError, match="synchronous scheduling"):
        SchedulerSetup(sessions=True, async_scheduling=True)


def test_a_kept_last_token_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    kept_last_token(monkeypatch)
    session = Session(SESSIONS)
    request = session.add(PROMPT, 1, resumable=True)
    run_until_paused(session, request)
    last = session.outputs.requests[request].received[-1]
    with pytest.raises(SchedulerViolation) as caught:
        session.resume(request, [3], 1)
    assert caught.value.check == Check.SESSIONS
    assert f"vLLM holds the session's tokens as {PROMPT + [last, 3]}, but its client knows {PROMPT + [3]}" in str(
        caught.value
    )


def test_a_stale_block_hash_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    stale_block_hashes(monkeypatch)
    session = Session(SESSIONS)
    request = session.add(PROMPT, 1, resumable=True)
    run_until_paused(session, request)
    with pytest.raises(SchedulerViolation) as caught:
        session.resume(request, [3], 1)
    assert caught.value.check == Check.SESSIONS and caught.value.cause == "a block hash kept past a session's update"
    assert "they differ from block 0 (its tokens [1, 2, 0, 3])" in str(caught.value)


def test_a_paused_session_that_gives_its_blocks_back_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    paused_session_freed(monkeypatch)
    session = Session(SESSIONS)
    request = session.add(PROMPT, 1, resumable=True)
    with pytest.raises(SchedulerViolation) as caught:
        for _ in range(4):
            session.step()
    assert caught.value.check == Check.ACCOUNTING and caught.value.request == request


def test_a_paused_session_scheduled_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    paused_session_scheduled(monkeypatch)
    session = Session(SESSIONS)
    request = session.add(PROMPT, 1, resumable=True)
    run_until_paused(session, request)
    with pytest.raises(SchedulerViolation) as caught:
        session.step()
    assert caught.value.check == Check.SESSIONS and caught.value.cause == "a paused session scheduled"
    assert "a session paused at its stop" in str(caught.value)


def test_a_turn_ended_by_its_length_reported_as_stop_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    every_turn_reported_stopped(monkeypatch)
    session = Session(SESSIONS)
    session.add(PROMPT, 1, resumable=True)
    with pytest.raises(SchedulerViolation) as caught:
        for _ in range(4):
            session.step()
    assert caught.value.check == Check.OUTPUTS and "finished with reason 'stop'" in str(caught.value)


@pytest.mark.parametrize(
    "bug, checks, named",
    [
        (kept_last_token, {Check.SESSIONS}, "tokens"),
        (stale_block_hashes, {Check.SESSIONS}, "block hash"),
        (paused_session_freed, {Check.ACCOUNTING, Check.EXCLUSIVE}, ""),
        (paused_session_scheduled, {Check.SESSIONS}, "a session paused at its stop"),
        (every_turn_reported_stopped, {Check.OUTPUTS}, "with reason 'stop'"),
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
    # a pool of 32 blocks: on 8, two resumed sessions that hold blocks while waiting deadlock the pool (vLLM
    # preempts only running requests), a progress failure found before the seeded bug
    found_and_replayed(capsys, tmp_path / "corpus", ["--sessions", "--num-blocks", "32"], checks, named)
    monkeypatch.undo()
