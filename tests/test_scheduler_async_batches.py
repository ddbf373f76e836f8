"""The async engine core's batch queue (kvfuzz.scheduler.async_batches) without vLLM: launches and returns in the
order of vLLM's ``EngineCore.step_with_batch_queue``, and the released-block check on a worker's tables. Driving
vLLM's AsyncScheduler with it is engine_tests/test_vllm_scheduler_async.py."""

from __future__ import annotations

import types
from typing import Any

import pytest
from factories import async_worker

from kvfuzz.scheduler.async_batches import Batch, BatchQueue, Progress, SynchronousLoop
from kvfuzz.scheduler.violations import Check, SchedulerViolation


class FakeEngine:
    """Launches steps scheduling the given token counts, one per launch, and logs launches and returns."""

    def __init__(self, scheduled: list[int]) -> None:
        self.pending = list(scheduled)  # tokens each future launch schedules
        self.log: list[str] = []  # "launch N" / "collect N", in order
        self.steps = 0

    def has_requests(self) -> bool:
        return bool(self.pending)

    def launch(self) -> Batch:
        self.steps += 1
        self.log.append(f"launch {self.steps}")
        return Batch(self.steps, None, None, self.pending.pop(0))

    def collect(self, batch: Batch) -> None:
        self.log.append(f"collect {batch.step}")


def test_two_batches_in_flight_returned_oldest_first_and_flushed_when_nothing_is_left() -> None:
    engine, queue = FakeEngine([4, 1, 1]), BatchQueue()
    progress = [queue.step(engine) for _ in range(5)]
    assert engine.log == ["launch 1", "launch 2", "collect 1", "launch 3", "collect 2", "collect 3"]
    assert progress == [
        Progress(4, False),  # room in the queue: return at once
        Progress(1, True),  # full: await step 1
        Progress(1, True),
        Progress(0, True),  # nothing to schedule: await step 3
        Progress(0, False),  # nothing at all
    ]
    assert queue.in_flight() == [] and not progress[-1]


def test_an_empty_step_with_nothing_more_to_schedule_is_returned_at_once() -> None:
    engine, queue = FakeEngine([0]), BatchQueue()
    assert queue.step(engine) == Progress(0, False)
    assert engine.log == ["launch 1", "collect 1"] and queue.in_flight() == []


def test_the_synchronous_loop_returns_every_step_it_launches() -> None:
    engine, loop = FakeEngine([3, 2]), SynchronousLoop()
    assert loop.step(engine) == Progress(3, False) and loop.in_flight() == []
    assert engine.log == ["launch 1", "collect 1"]


def worker(tables: dict[str, list[int]], computed: dict[str, int], live: tuple[str, ...]) -> Any:
    return async_worker(tables, computed, live)


def output(scheduled: dict[str, int]) -> Any:
    return types.SimpleNamespace(num_scheduled_tokens=scheduled)


def released_write(queue: BatchQueue) -> None:
    """Step 1 reads block 5 for r0 (in flight); r0 releases it; step 2 writes r1's prompt into block 5."""
    queue.before_execute(output({"r0": 3}), worker({"r0": [5]}, {"r0": 0}, ("r0",)), 1)
    queue.before_execute(output({"r1": 2}), worker({"r1": [5]}, {"r1": 0}, ("r1",)), 2)


def test_a_released_block_rewritten_while_read_in_flight_is_counted_when_the_stream_orders_it() -> None:
    queue = BatchQueue()
    released_write(queue)
    assert queue.rewrites == 1
    assert queue.readers[5] == {1: {"r0"}, 2: {"r1"}}


def test_a_released_block_rewritten_while_read_in_flight_fails_when_nothing_orders_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(BatchQueue, "ordered", lambda self, reader, writer: False)
    with pytest.raises(SchedulerViolation) as caught:
        released_write(BatchQueue())
    assert caught.value.check is Check.RELEASED and caught.value.step == 2 and caught.value.request == "r1"
    assert "into block 5, which request(s) ['r0'] released" in str(caught.value)
    assert "while step 1, which reads it for them, is in flight" in str(caught.value)


def released_state_write(queue: BatchQueue) -> None:
    """A Mamba hybrid: step 1 reads and writes r0's state in block 7 (in flight); r0 releases its blocks; step 2 writes
    r1's K/V into block 6 and its state into block 7."""
    queue.before_execute(output({"r0": 3}), async_worker({"r0": [5]}, {"r0": 0}, ("r0",), states={"r0": 7}), 1)
    queue.before_execute(output({"r1": 2}), async_worker({"r1": [6]}, {"r1": 0}, ("r1",), states={"r1": 7}), 2)


def test_a_released_state_block_rewritten_while_in_flight_is_counted_and_fails_when_states_are_not_ordered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    queue = BatchQueue()
    released_state_write(queue)
    assert queue.rewrites == 1 and queue.readers[7] == {1: {"r0"}, 2: {"r1"}}
    monkeypatch.setattr(BatchQueue, "state_ordered", lambda self, reader, writer: False)
    with pytest.raises(SchedulerViolation) as caught:
        released_state_write(BatchQueue())
    assert str(caught.value) == (
        "released check failed at step 2, request r1: step 2 writes request r1's Mamba state (after 2 token(s)) into "
        "block 7, which request(s) ['r0'] released (no table of theirs holds it now) while step 1, which reads it for "
        "them, is in flight (its output not yet returned), and the device does not run step 2's writes after step 1's "
        "reads"
    )


def test_a_block_still_held_or_a_reader_returned_is_no_hazard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BatchQueue, "ordered", lambda self, reader, writer: False)
    queue = BatchQueue()
    queue.before_execute(output({"r0": 3}), worker({"r0": [5]}, {"r0": 0}, ("r0",)), 1)
    # r0 still holds block 5 (a prefix-cache share): r1's write into it is the exclusive check's business
    queue.before_execute(output({"r1": 1}), worker({"r0": [5], "r1": [5]}, {"r1": 3}, ("r0", "r1")), 2)
    engine = FakeEngine([])
    queue.batches.extendleft([Batch(1, None, None, 3), Batch(2, None, None, 1)])
    queue.step(engine)  # step 1's output returns: its reads are over
    assert engine.log == ["collect 1"]
    # r0 released it since step 1 returned; r1 (step 2, in flight) still holds it
    queue.before_execute(output({"r2": 2}), worker({"r1": [5], "r2": [5]}, {"r2": 0}, ("r1", "r2")), 3)
    assert queue.rewrites == 0
