"""vLLM's engine core under async scheduling: two batches in flight, and the check on blocks released while a step
in flight still reads them.

With ``async_scheduling`` vLLM's engine core (``EngineCore.step_with_batch_queue``, a queue of depth
``max_concurrent_batches``, 2 without pipeline parallelism) schedules step N+1 and launches it before step N's output
has come back: ``schedule()``, the model runner's non-blocking ``execute_model``, and only when the queue is full (or
nothing else can be scheduled) the oldest batch's output is awaited and handed to ``update_from_output``, in launch
order. The ``AsyncScheduler`` counts the token each launched decode will sample as an *output placeholder* and
schedules the next decode on it, before the token is known.

kvfuzz's worker runs a step when it is launched, as vLLM's GPU model runner does: each step is queued on one stream,
so its K/V writes come after the reads of every step launched before it. The output of the step is kept in the queue
and returned to the scheduler later. :class:`BatchQueue` keeps, for each block, the steps in flight whose attention
reads it and for which requests; a block a request released (finished, aborted, preempted: no table of the request
holds it any more) while such a step is in flight, written by a later step before that step's output returned, is
the hazard async scheduling opens. vLLM 0.33.0 returns such a block to the free queue at once (it defers frees only
for a KV-consumer connector, whose loads are not ordered on the stream) and relies on the stream's order; the check
holds the write path to that order (:meth:`BatchQueue.ordered`), and counts each such rewrite, so a run says how
often the hazard was reached."""

from __future__ import annotations

import collections
from typing import Any, Callable, Protocol

import attrs

from kvfuzz.scheduler.violations import Check, SchedulerViolation

DEPTH = 2
"""Batches in flight: vLLM's ``max_concurrent_batches`` under async scheduling without pipeline parallelism."""


@attrs.frozen
class Batch:
    """One launched step: its number (the ``schedule()`` call), the scheduler's output and the model runner's output,
    held back until the engine core awaits it."""

    step: int
    output: Any  # the SchedulerOutput
    result: Any  # the ModelRunnerOutput
    scheduled: int  # tokens it scheduled


class Engine(Protocol):
    """What the queue drives: :class:`kvfuzz.scheduler.session.Session`."""

    def has_requests(self) -> bool: ...

    def launch(self) -> Batch: ...

    def collect(self, batch: Batch) -> None: ...


@attrs.frozen
class Progress:
    """What one engine step did: the tokens it scheduled, and whether it returned a batch that computed some."""

    scheduled: int
    collected: bool

    def __bool__(self) -> bool:
        return self.scheduled > 0 or self.collected


class SynchronousLoop:
    """vLLM's engine core without async scheduling (``EngineCore.step``): each step is scheduled, executed and its
    output returned before the next is scheduled; nothing is ever in flight between steps."""

    rewrites = 0  # blocks rewritten while a step reading them for their former owner was in flight: never

    def in_flight(self) -> list[int]:
        """The steps launched whose output has not returned: none between steps."""
        return []

    def step(self, engine: Engine) -> Progress:
        batch = engine.launch()
        engine.collect(batch)
        return Progress(batch.scheduled, False)

    def before_execute(self, output: Any, worker: Any, step: int) -> None:
        """Nothing is in flight when a step runs."""


class BatchQueue:
    """vLLM's engine core with async scheduling: up to :data:`DEPTH` batches in flight, returned in launch order.

    Invariants: ``batches`` holds the launched steps whose output has not been returned, newest first;
    ``readers[block][step]`` is the set of requests whose attention step ``step`` (in flight) reads ``block`` for;
    no step writes a block that a request released while a step reading it for that request is in flight, unless
    the device runs the write after that step (:meth:`ordered`)."""

    def __init__(self) -> None:
        self.batches: collections.deque[Batch] = collections.deque()  # in flight, newest first
        self.readers: dict[int, dict[int, set[str]]] = {}  # block -> in-flight step -> requests it reads it for
        self.rewrites = 0  # released blocks written while a step that read them is in flight (ordered by the stream)

    def in_flight(self) -> list[int]:
        """The steps launched whose output has not returned, oldest first."""
        return [batch.step for batch in reversed(self.batches)]

    def ordered(self, reader: int, writer: int) -> bool:
        """Whether the device runs step ``writer``'s writes after step ``reader``'s reads: vLLM's GPU model runner
        queues every step on one stream, so a step launched later runs after."""
        return reader < writer

    def state_ordered(self, reader: int, writer: int) -> bool:
        """Whether the device runs step ``writer``'s Mamba state writes after step ``reader``'s reads: vLLM's runner
        copies and updates the states on the step's stream too (align mode's pre-copy is a kernel of the step), so
        as :meth:`ordered`."""
        return self.ordered(reader, writer)

    def step(self, engine: Engine) -> Progress:
        """One call of ``step_with_batch_queue``: launch a step if the scheduler has requests, and return the oldest
        batch unless the queue has room and there is more to launch."""
        scheduled = 0
        if engine.has_requests():
            batch = engine.launch()
            scheduled = batch.scheduled
            self.batches.appendleft(batch)
            if len(self.batches) < DEPTH and (scheduled > 0 or engine.has_requests()):
                return Progress(scheduled, False)
        elif not self.batches:
            return Progress(0, False)
        oldest = self.batches.pop()
        for steps in self.readers.values():
            steps.pop(oldest.step, None)
        engine.collect(oldest)
        return Progress(scheduled, oldest.scheduled > 0)

    def before_execute(self, output: Any, worker: Any, step: int) -> None:
        """Check the blocks the worker is about to write for ``step`` against the in-flight steps that read them, then
        record the blocks this step reads. Called once the worker has read ``output`` (its tables are the
        scheduler's) and before it writes. Every KV-cache group's table counts: a step writes each scheduled
        position's block in every group, and reads, in each group, the entries from the first position its tokens
        attend (a sliding window's, not those behind it); a Mamba group's state blocks count as the step reads and
        writes them (:meth:`~kvfuzz.scheduler.mamba_states.MambaStates.touched`); a request has released a block that
        is in no entry its groups still need (:meth:`~kvfuzz.scheduler.worker.Worker.holdings`)."""
        size = worker.block_size
        held = {request: set(blocks) for request, blocks in worker.holdings()[0].items()}
        for request, count in output.num_scheduled_tokens.items():
            start = worker.computed[request]
            tables = worker.requests[request].tables
            written = {
                table[position // size]
                for table in (tables[rule.index] for rule in worker.groups)
                for position in range(start, start + count)
                if position // size < len(table) and table[position // size] != 0
            }
            for block in sorted(written):
                what = f"request {request}'s K/V (from position {start})"
                self._check_write(block, request, what, step, held, worker.requests, self.ordered)
            for block in sorted(worker.mamba.touched(tables, range(start, start + count))[1]):
                what = f"request {request}'s Mamba state (after {start + count} token(s))"
                self._check_write(block, request, what, step, held, worker.requests, self.state_ordered)
        for request, count in output.num_scheduled_tokens.items():
            start = worker.computed[request]
            end = start + count
            state = worker.requests[request]
            tables = state.tables
            read = {
                block
                for rule in worker.groups
                for run in rule.attended(start, end, state.prompt_length)
                for block in tables[rule.index][run.start // size : -(-run.stop // size)]
                if block != 0
            }
            for block in read | worker.mamba.touched(tables, range(start, end))[0]:
                self.readers.setdefault(block, {}).setdefault(step, set()).add(request)

    def _check_write(
        self,
        block: int,
        writer: str,
        what: str,
        step: int,
        held: dict[str, set[int]],
        states: dict[str, Any],
        ordered: Callable[[int, int], bool],
    ) -> None:
        """Step ``step`` writes ``what`` (of request ``writer``) into ``block``, in the order ``ordered`` says the
        device runs it after a reader."""
        for reader, requests in sorted(self.readers.get(block, {}).items()):
            released = sorted(request for request in requests if block not in held.get(request, ()))
            if reader == step or not released:
                continue
            if ordered(reader, step):
                self.rewrites += 1
                continue
            raise SchedulerViolation(
                Check.RELEASED,
                step,
                writer,
                f"step {step} writes {what} into block {block}, which "
                f"request(s) {released} released (no table of theirs holds it now) while step {reader}, which reads "
                f"it for them, is in flight (its output not yet returned), and the device does not run step {step}'s "
                f"writes after step {reader}'s reads",
                released_cause(writer, released, states),
            )


def released_cause(writer: str, released: list[str], requests: dict[str, Any]) -> str:
    """Who released the block a write reuses too early, as the worker knows them (``requests``: its live and preempted
    requests' states; a request not among them finished or was aborted): the writer itself, a preempted request, or
    a finished one."""
    if writer in released:
        return "a block the writer itself released"
    if any(request in requests and requests[request].preempted for request in released):
        return "a preempted request's block"
    return "a block of a finished or dropped request"
