"""vLLM's AsyncScheduler in the loop (async_batches, docs/scheduler-async.md): driven as vLLM's engine core
drives it under async scheduling (two batches in flight, outputs returned in order), the unmodified scheduler passes,
and each check is shown catching a seeded bug under async scheduling, with the message it names.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there): without vLLM 0.33.0 the import
fails loudly rather than skipping."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kvfuzz.cli import main
from kvfuzz.scheduler.async_batches import BatchQueue, Progress
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.export import export_test
from kvfuzz.scheduler.fake_model import expected_output
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.trace import load
from kvfuzz.scheduler.violations import Check, SchedulerViolation

ASYNC = SchedulerSetup(num_blocks=8, async_scheduling=True)  # small enough that the scheduler preempts
PREFIX = [1, 2, 3, 0, 2, 2, 1, 3]  # two full blocks of 4


def test_the_unmodified_async_scheduler_passes_and_reaches_preemption_hits_and_released_rewrites() -> None:
    outcome = search(ASYNC, examples=25, steps=30)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0 and outcome.hit_tokens > 0, outcome.describe()
    assert outcome.rewrites > 0, outcome.describe()  # the hazard the released check watches is reached
    assert "released blocks written while a step that read it was in flight" in "\n".join(outcome.describe())


def test_the_engine_core_schedules_the_next_step_on_a_placeholder_before_the_last_output_returns() -> None:
    session = Session(ASYNC)
    assert type(session.scheduler) is AsyncScheduler
    session.add(PREFIX + [1], 3)
    assert session.step() == 9  # the prompt, launched; its output (the first token) stays in flight
    assert session.loop.in_flight() == [1] and session.outputs.requests["r0"].received == []
    assert session.scheduler.requests["r0"].num_output_placeholders == 1
    assert session.step() == 1  # the decode of the token not yet returned, launched; then the prompt's output returns
    assert session.loop.in_flight() == [2]
    assert session.outputs.requests["r0"].received == expected_output("r0", 9, 1)
    session.drain()
    assert session.outputs.requests["r0"].received == expected_output("r0", 9, 3)
    assert session.loop.in_flight() == [] and session.worker.requests == {}
    assert session.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == ASYNC.num_blocks


def test_released_catches_a_write_the_device_runs_before_the_in_flight_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model runner that writes each step's K/V without waiting for the steps in flight (a side stream with no
    event): vLLM hands a block released while a step reads it to the next step at once, so the write races the read."""
    monkeypatch.setattr(BatchQueue, "ordered", lambda self, reader, writer: False)
    outcome = search(ASYNC, examples=50, steps=30)
    assert outcome.check() == "released", outcome.describe()
    assert outcome.failure is not None and getattr(outcome.failure, "cause", None) in (
        "a block of a finished or dropped request",
        "a preempted request's block",
        "a block the writer itself released",
    ), outcome.describe()
    assert re.search(
        r"released check failed at step (\d+), request r\d+: step \1 writes request r\d+'s K/V \(from position \d+\) "
        r"into block \d+, which request\(s\) \['r\d+'(, 'r\d+')*\] released \(no table of theirs holds it now\) while "
        r"step (\d+), which reads it for them, is in flight \(its output not yet returned\), and the device does not "
        r"run step \1's writes after step \3's reads",
        outcome.explanation(),
    ), outcome.describe()
    assert "state.add_request(" in outcome.program and "state.step()" in outcome.program


def test_vllm_reuses_a_block_released_while_read_in_flight_at_once_relying_on_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shrunk program of scheduler-async.md: r0's prompt is launched (step 1, reading block 1), r0 is aborted while
    step 1 is in flight, and step 2 writes r1's prompt into the same block before step 1's output returns. vLLM 0.33.0
    (no KV connector, so no deferred frees) does it by design, relying on the stream's order: counted as a rewrite,
    and a violation only for a device that does not order step 2 after step 1."""

    def program(session: Session) -> None:
        session.add([0], 1)
        session.step()
        session.abort("r0")
        session.add([0], 1)
        session.step()

    session = Session(ASYNC)
    program(session)
    assert session.loop.rewrites == 1
    session.drain()
    monkeypatch.setattr(BatchQueue, "ordered", lambda self, reader, writer: False)
    with pytest.raises(SchedulerViolation) as caught:
        program(Session(ASYNC))
    assert str(caught.value) == (
        "released check failed at step 2, request r1: step 2 writes request r1's K/V (from position 0) into block 1, "
        "which request(s) ['r0'] released (no table of theirs holds it now) while step 1, which reads it for them, is "
        "in flight (its output not yet returned), and the device does not run step 2's writes after step 1's reads"
    )


def test_a_request_writing_a_block_it_still_holds_released_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """r0's prompt (one token, block 1) is launched as step 1; step 2 writes its next token into block 1 while step 1,
    which read it for r0, is in flight. r0 still holds block 1, so nothing was released and nothing is counted or
    failed, even for a device that orders nothing (the check once compared a block with the request's per-group
    tables, a list of lists, and took every block read in flight for released)."""
    monkeypatch.setattr(BatchQueue, "ordered", lambda self, reader, writer: False)
    session = Session(ASYNC)
    session.add([0], 3)
    session.step()
    session.step()
    assert session.worker.requests["r0"].table == [1] and session.loop.in_flight() == [2]
    assert session.loop.rewrites == 0
    session.drain()
    assert session.outputs.requests["r0"].received == expected_output("r0", 1, 3)


def test_accounting_under_async_catches_finished_requests_never_told_to_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``update_from_output`` of step N frees a finished request's blocks while step N+1 is in flight; the worker
    learns of it from the next ``schedule()``'s finished ids, and the check runs right after it read them. A
    scheduler that loses those ids leaves the worker holding freed blocks."""
    original = Scheduler.update_from_output

    def update_from_output(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
        outputs = original(self, *args, **kwargs)
        self.finished_req_ids.clear()
        return outputs

    monkeypatch.setattr(Scheduler, "update_from_output", update_from_output)
    session = Session(ASYNC)
    session.add(PREFIX + [1], 2)
    session.add([3, 3, 3], 8)
    with pytest.raises(SchedulerViolation) as caught:
        session.drain()
    assert caught.value.check is Check.ACCOUNTING
    assert re.search(
        r"accounting check failed at step \d+, request r0: block \d+ is held by the tables of 1 running request\(s\) "
        r"\['r0'\] \(expected ref_cnt 1, not free\), but the manager's block is in the free queue",
        str(caught.value),
    ), caught.value


def test_outputs_under_async_catch_a_placeholder_counted_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The AsyncScheduler counting two placeholders for a decode that samples one: it reports more output tokens
    to the worker than the model sampled."""
    original = AsyncScheduler._update_after_schedule

    def update_after_schedule(self: AsyncScheduler, scheduler_output: Any) -> None:
        original(self, scheduler_output)
        for request in scheduler_output.num_scheduled_tokens:
            if self.requests[request].num_output_placeholders:
                self.requests[request].num_output_placeholders += 1

    monkeypatch.setattr(AsyncScheduler, "_update_after_schedule", update_after_schedule)
    session = Session(ASYNC)
    session.add(PREFIX + [1], 6)
    with pytest.raises(SchedulerViolation) as caught:
        session.drain()
    assert caught.value.check is Check.OUTPUTS
    assert re.search(
        r"outputs check failed at step 2, request r0: the scheduler counts 2 output tokens, but the fake model "
        r"sampled 1",
        str(caught.value),
    ), caught.value


def test_progress_under_async_catches_a_batch_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine core that awaits a batch only when the queue is full: once nothing more can be scheduled, the last
    batch stays in flight and the drain cannot end."""

    def step(self: BatchQueue, engine: Any) -> Progress:
        if not engine.has_requests():
            return Progress(0, False)
        batch = engine.launch()
        self.batches.appendleft(batch)
        if len(self.batches) < 2:
            return Progress(batch.scheduled, False)
        oldest = self.batches.pop()
        engine.collect(oldest)
        return Progress(batch.scheduled, oldest.scheduled > 0)

    monkeypatch.setattr(BatchQueue, "step", step)
    session = Session(ASYNC)
    session.add(PREFIX + [1], 3)
    with pytest.raises(SchedulerViolation) as caught:
        session.drain()
    assert caught.value.check is Check.PROGRESS
    assert re.search(
        r"progress check failed at step \d+: every request finished, but 3 steps later the batch\(es\) of step\(s\) "
        r"\[\d+\] are still in flight \(their output never returned\)",
        str(caught.value),
    ), caught.value


def test_the_cli_s_async_option_is_recorded_in_the_trace_and_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = ["run", "--scheduler", "vllm-v1", "--num-blocks", "8", "--async-scheduling"]
    assert main([*run, "--examples", "5", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["failed"] is False and summary["steps"] > 0 and "released_rewrites" in summary
    monkeypatch.setattr(BlockPool, "touch", lambda self, blocks: None)  # a prefix hit that takes no reference
    corpus = tmp_path / "corpus"
    assert main([*run, "--examples", "30", "--corpus", str(corpus), "--no-shrink"]) == 1
    capsys.readouterr()
    (path,) = sorted(corpus.glob("*.json"))
    assert json.loads(path.read_text())["config"]["async_scheduling"] is True
    trace = load(path)
    assert trace.setup.async_scheduling and "async scheduling" in trace.describe()[1]
    assert "prefix_caching=True, policy='fcfs', async_scheduling=True)" in export_test(trace, str(path))
    replayed = replay(trace)
    assert replayed.reproduced and replayed.identical, replayed.describe_failure()
    monkeypatch.undo()
    assert replay(trace).failure is None  # passes without the bug
