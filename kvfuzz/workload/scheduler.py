"""A continuous-batching scheduler that replays a workload through kvfuzz's engine.

Each scheduling round before step t: start the branches running requests still lack (fork a sample from its
computed prompt, or admit it beside the prompt where the allocator cannot fork; readmit a preempted one); grow every
running branch by its next token; unless the round preempted, admit waiting requests first come, first served
(preempted ones first) until one is refused; cancel what the trace cancels at t, wherever it is (so a request
cancelled on arrival is admitted and aborted before its first step); then run step t. When the pool is full, the
most recently admitted request is preempted for recomputation; a request running alone is never its own victim (it
would need back every block it gave up), it waits. A branch finishes, and is freed, once it has produced its output
length. A request refused while nothing else runs, in a round where it made no progress, once every block released
before has come back from its in-flight window, can never fit and is rejected. Every operation goes through
:class:`~kvfuzz.engine.Engine`, so every invariant is checked exactly as in a fuzzing run.
"""

from __future__ import annotations

import enum
import functools
import time
from collections import Counter
from typing import Callable, Optional

import attrs

from kvfuzz.accounting.occupancy import OccupancyLog
from kvfuzz.allocator.protocol import AllocatorProtocol
from kvfuzz.allocator.types import SeqId
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.engine import Engine
from kvfuzz.engine.expected import Status
from kvfuzz.engine.violations import InvariantViolation
from kvfuzz.text import plural
from kvfuzz.workload.format import MAX_STEPS, Request, Workload
from kvfuzz.workload.report import Latency, Preemption, Refusal, ReplayReport


def minimum_steps(workload: Workload, max_running: int, block_size: int, num_blocks: int) -> int:
    """A lower bound on the steps a replay of ``workload`` takes, counting only the requests the pool can hold
    (a longer one is rejected at once): none finishes before its arrival plus its output; each runs a step per
    output token (up to its cancellation), at most ``max_running`` at once; and a request holds, at its t-th output
    token, at least the blocks of its prompt and t tokens, all of them within the pool's ``num_blocks`` at each step
    (the area its requests fill over their steps, divided by the pool)."""
    fitting = [
        request for request in workload.requests if len(request.prompt) + request.output_len <= num_blocks * block_size
    ]
    if not fitting:
        return 0

    def blocks_through(tokens: int) -> int:  # the sum of ceil(x / block_size) for x = 1 .. tokens
        whole, rest = divmod(tokens, block_size)
        return block_size * whole * (whole + 1) // 2 + rest * (whole + 1)

    work = {
        request.id: min(request.output_len, request.cancel_at - request.arrival + 1)
        if request.cancel_at is not None
        else request.output_len
        for request in fitting
    }
    area = sum(
        blocks_through(len(request.prompt) + work[request.id]) - blocks_through(len(request.prompt))
        for request in fitting
    )
    latest = max(request.arrival + work[request.id] for request in fitting)
    return max(latest, -(-sum(work.values()) // max_running), -(-area // num_blocks))


class ReplayError(RuntimeError):
    """The workload cannot be replayed against this allocator (e.g. it needs a capability the allocator lacks)."""


class Phase(enum.Enum):
    PENDING = "not yet arrived or admitted"
    WAITING = "waiting (preempted)"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    TIMED_OUT = "timed out"


DONE = (Phase.FINISHED, Phase.CANCELLED, Phase.REJECTED, Phase.TIMED_OUT)


@attrs.define
class Tracked:
    """A request's progress. ``produced[b]`` counts the tokens branch b has produced (all but the last are in its
    K/V); a branch is in ``produced`` once it has been started. Branch 0 is the request's own id; others are
    ``id/j``, forked from branch 0 once its prompt is computed (or admitted beside it when the allocator cannot
    fork). Branch 0 stays until its branches are forked, even past its output length."""

    request: Request
    branches: list[SeqId]
    produced: dict[SeqId, int] = attrs.field(factory=dict)
    phase: Phase = Phase.PENDING
    admitted_at: Optional[int] = None
    first_token_at: Optional[int] = None
    finished_at: Optional[int] = None
    preempted: int = 0

    def live(self) -> list[SeqId]:
        return [branch for branch in self.branches if branch in self.produced]

    def done(self, branch: SeqId) -> bool:
        return self.produced.get(branch, 0) >= self.request.output_len

    def holds_for_forks(self, branch: SeqId, fork: bool) -> bool:
        """Branch 0 of a request whose samples fork from its prompt neither grows nor finishes until they have."""
        return fork and branch == self.branches[0] and len(self.produced) < len(self.branches)


PROGRESS_SECONDS = 5.0
"""Seconds between two progress lines of a replay (a long one runs for minutes)."""


class Scheduler:
    """Drives one workload through one engine; :meth:`run` returns the report. A workload that has not drained
    when ``max_steps`` steps have run is stopped there: the report says so (``undrained``), which is no failure of
    the allocator (it broke no invariant), but a workload too long for the pool and ``max_running``."""

    def __init__(
        self,
        workload: Workload,
        allocator: AllocatorProtocol,
        config: MachineConfig,
        allocator_name: str,
        max_running: int = 256,
        max_steps: int = MAX_STEPS,
        progress: Optional[Callable[[str], None]] = None,
    ) -> None:
        if any(request.namespace for request in workload.requests) and not allocator.capabilities.namespaces:
            raise ReplayError(
                f"workload {workload.name} gives requests namespaces, but {allocator_name} does not "
                "declare namespace support: its cache hits could not be judged"
            )
        if allocator.capabilities.async_loads:
            raise ReplayError(
                f"{allocator_name} declares async_loads: workload replay does not yet model requests waiting for "
                "their loads (kvfuzz run and kvfuzz campaign drive them)"
            )
        if max_running < 1:
            raise ReplayError(f"max_running must be >= 1, got {max_running}")
        needed = minimum_steps(workload, max_running, config.block_size, config.num_blocks)
        if needed > max_steps:
            raise ReplayError(
                f"workload {workload.name} cannot drain within the {max_steps:,} steps a replay runs: its "
                f"{len(workload.requests):,} requests' outputs need at least {needed:,} steps, at most {max_running} "
                f"running at once (--max-running), each holding its blocks in a pool of {config.num_blocks} blocks "
                "(a larger pool, or fewer or shorter requests, drain sooner)"
            )
        self.workload, self.config, self.allocator_name = workload, config, allocator_name
        self.max_running, self.max_steps = max_running, max_steps
        self.progress = progress  # told where the replay is every PROGRESS_SECONDS (None: nobody)
        self.log = OccupancyLog()
        self.engine = Engine(allocator, config, Counter(), on_step=self.log.record)
        self.fork = allocator.capabilities.fork
        self.inflight_window = allocator.capabilities.inflight_window
        self.preempt_scheduled = allocator.capabilities.preempt_scheduled
        self.preemption = allocator.capabilities.preemption  # False: the engine never preempts
        self.tracked = [
            Tracked(request, [request.id] + [f"{request.id}/{j}" for j in range(1, request.samples)])
            for request in workload.requests
        ]
        self.waiting: list[Tracked] = []
        self.running: list[Tracked] = []
        self.refusals: list[Refusal] = []
        self.preemption_samples: list[Preemption] = []  # every preemption: when, whom, for which request
        self.concurrency: list[int] = []
        self.scheduled: set[SeqId] = set()
        self.progressed: set[str] = set()  # requests that started or grew a branch this round
        self.stalled: set[str] = set()  # requests refused this round while no other request ran
        self.settled_from = 0  # the first round in which every block released so far is back from its window
        self.preempted_this_round = False
        self.step = 0

    # -- one round -------------------------------------------------------------------------------------------------

    def run(self) -> ReplayReport:
        started = time.perf_counter()
        told = started
        failure: Optional[str] = None
        undrained: Optional[str] = None
        quiescent = False
        try:
            arrivals = iter(self.tracked)
            upcoming = next(arrivals, None)
            while not all(tracked.phase in DONE for tracked in self.tracked):
                if self.step >= self.max_steps:
                    undrained = self._undrained()
                    break
                while upcoming is not None and upcoming.request.arrival <= self.step:
                    self.waiting.append(upcoming)
                    upcoming = next(arrivals, None)
                self._schedule()
                self._cancel()
                self._run_step()
                if self.progress is not None and time.perf_counter() - told >= PROGRESS_SECONDS:
                    told = time.perf_counter()
                    self.progress(self._where(told - started))
            if undrained is None:
                self.engine.quiesce()
                quiescent = True
        except InvariantViolation as violation:
            failure = f"{violation.invariant}\n{violation.explain()}"
        except Exception as error:  # noqa: BLE001 -- whatever the allocator raised is the finding, with the report
            failure = (
                f"crash ({type(error).__name__}) during {self.engine.checks.operation} at step {self.step}: {error}"
            )
        return self._report(time.perf_counter() - started, failure, quiescent, undrained)

    def _where(self, seconds: float) -> str:
        """A progress line: the step, the requests done, running and waiting, and when the step limit would come."""
        done = sum(tracked.phase in DONE for tracked in self.tracked)
        left = (self.max_steps - self.step) * seconds / max(self.step, 1)
        return (
            f"  {self.workload.name}: step {self.step:,} after {seconds:.0f} s, {done:,} of "
            f"{plural(len(self.tracked), 'request')} done, {len(self.running)} running, {len(self.waiting)} waiting "
            f"(a replay stops at step {self.max_steps:,}: in about {left:.0f} s at this pace)"
        )

    def _undrained(self) -> str:
        """Why the replay stopped at its step limit, for a person, on one line."""
        stuck = [tracked.request.id for tracked in self.tracked if tracked.phase not in DONE]
        named = ", ".join(stuck[:3]) + (f" and {len(stuck) - 3:,} more" if len(stuck) > 3 else "")
        return (
            f"workload {self.workload.name} did not drain within {self.max_steps:,} steps (the most a replay runs) "
            f"against {self.allocator_name} in a pool of {plural(self.config.num_blocks, 'block')} x "
            f"{plural(self.config.block_size, 'slot')} with at most {self.max_running} running: "
            f"{plural(len(stuck), 'request')} still open ({named}); no invariant broke: the workload is too long for "
            "this pool, give it more room or fewer requests"
        )

    def _schedule(self) -> None:
        """The scheduling decisions of one round, before cancellations: start branches, decode, admit."""
        self._start_branches()
        self._decode()
        self._admit()

    def _cancel(self) -> None:
        for tracked in self.tracked:
            cancel_at = tracked.request.cancel_at
            if (
                cancel_at is not None
                and cancel_at <= self.step
                and tracked.request.arrival <= self.step
                and tracked.phase not in DONE
            ):
                self._release(tracked)
                tracked.phase = Phase.CANCELLED

    def _release(self, tracked: Tracked) -> None:
        """Free every branch the engine still holds (cancel, rejection) and drop the request from the queues."""
        for branch in tracked.live():
            if branch in self.engine.expected.seqs:
                self.engine.dismiss(branch)
                self._released()
        tracked.produced.clear()
        for queue in (self.waiting, self.running):
            if tracked in queue:
                queue.remove(tracked)

    # -- starting branches -----------------------------------------------------------------------------------------

    def _pending(self, tracked: Tracked) -> list[SeqId]:
        """Branches with no blocks that could be given some now: preempted ones, and unstarted ones (with a fork,
        only once branch 0's prompt is computed)."""
        engine, parent = self.engine, tracked.branches[0]
        pending = []
        for index, branch in enumerate(tracked.branches):
            model = engine.expected.seqs.get(branch)
            if model is not None and model.status is Status.PREEMPTED:
                pending.append(branch)
            elif branch not in tracked.produced and (
                index == 0
                or not self.fork
                or (parent in engine.expected.computed_ids() and tracked.produced.get(parent, 0) >= 1)
            ):
                pending.append(branch)
        return pending

    def _start(self, tracked: Tracked, branch: SeqId) -> bool:
        """Give ``branch`` blocks: readmit it, fork it from branch 0, or admit it with the prompt."""
        request, engine = tracked.request, self.engine
        model = engine.expected.seqs.get(branch)
        if model is not None and model.status is Status.PREEMPTED:
            started = engine.readmit(branch)
        elif branch != tracked.branches[0] and self.fork:
            started = engine.fork(tracked.branches[0], branch)
            if started:
                tracked.produced[branch] = 1  # its first token was sampled by the parent's prefill
                self._progressed(tracked)
                return True
        else:
            started = engine.admit(branch, request.namespace, request.prompt)
        if started:
            tracked.produced.setdefault(branch, 0)
            self.scheduled.add(branch)
            self._progressed(tracked)
        else:
            self._refused(tracked, branch)
        return started

    def _start_branches(self) -> None:
        """Running requests' branches that lack blocks get them, making room as a grow would."""
        for tracked in list(self.running):
            for branch in self._pending(tracked):
                if tracked not in self.running or not self._with_room(
                    tracked, functools.partial(self._start, tracked, branch)
                ):
                    break

    # -- decoding ----------------------------------------------------------------------------------------------------

    def _decode(self) -> None:
        for tracked in list(self.running):
            for branch in tracked.live():
                if tracked not in self.running:
                    break
                model = self.engine.expected.seqs.get(branch)
                if (
                    model is None
                    or model.status is not Status.RUNNING
                    or tracked.done(branch)
                    or branch not in self.engine.expected.computed_ids()
                ):
                    continue
                if tracked.holds_for_forks(branch, self.fork):
                    continue
                token = tracked.request.output_token(tracked.branches.index(branch), tracked.produced[branch] - 1)
                if self._with_room(tracked, functools.partial(self.engine.grow, branch, (token,))):
                    self.scheduled.add(branch)
                    self._progressed(tracked)

    def victims(self) -> list[Tracked]:
        """Running requests that may be preempted now, most recently admitted first (none where the engine never
        preempts)."""
        if not self.preemption:
            return []
        return [
            other
            for other in reversed(self.running)
            if self.preempt_scheduled or not any(seq in self.scheduled for seq in other.live())
        ]

    def _with_room(self, tracked: Tracked, attempt: Callable[[], bool]) -> bool:
        """Run ``attempt``, preempting the most recently admitted request while the pool is full.

        Under an in-flight window W > 0 a preempted request's blocks come back only W steps later, so one victim is
        preempted and ``tracked`` waits this round instead of preempting everything behind it. An engine that never
        preempts scheduled work (``preempt_scheduled`` false) takes victims only among requests with nothing
        scheduled this round; with none, ``tracked`` waits, as it always does where the engine never preempts. A
        request running alone is not preempted for its own sake: readmitting it would need every block it gave up,
        and more. It waits, and counts as stalled (see :meth:`_reject_stalled`)."""
        while not attempt():
            if all(other is tracked for other in self.running):
                self.stalled.add(tracked.request.id)
                return False
            victims = self.victims()
            if not victims:
                return False
            victim = victims[0]
            self.preemption_samples.append(
                Preemption(self.step, victim.request.id, tracked.request.id, self._free_blocks())
            )
            self._preempt(victim)
            self.preempted_this_round = True
            if victim is tracked or self.inflight_window > 0:
                return False
        return True

    def _preempt(self, tracked: Tracked) -> None:
        """Release every running branch of ``tracked`` for recomputation; it goes to the front of the queue."""
        prompt = len(tracked.request.prompt)
        for branch in tracked.live():
            model = self.engine.expected.seqs.get(branch)
            if model is None or model.status is Status.PREEMPTED:
                continue  # finished already, or waiting for readmission
            self.engine.preempt(branch)
            self._released()
            self.scheduled.discard(branch)
            tracked.produced[branch] = max(0, self.engine.expected.length(branch) - prompt)  # 0 inside a prompt
        tracked.preempted += 1
        tracked.phase = Phase.WAITING
        self.running.remove(tracked)
        self.waiting.insert(0, tracked)

    # -- admission ---------------------------------------------------------------------------------------------------

    def _admit(self) -> None:
        if self.preempted_this_round:  # as vLLM's scheduler: no admissions in a round that had to preempt
            return
        while self.waiting and len(self.running) < self.max_running:
            tracked = self.waiting[0]
            pending = self._pending(tracked)
            started = 0
            for branch in pending:
                if not self._start(tracked, branch):
                    break
                started += 1
            if not started:
                return
            self.waiting.pop(0)
            self.running.append(tracked)
            tracked.phase = Phase.RUNNING
            if tracked.admitted_at is None:
                tracked.admitted_at = self.step
            if started < len(pending):
                return  # the rest of its branches start in later rounds; nothing behind it is admitted now

    def _free_blocks(self) -> Optional[int]:
        """Free blocks in the pool now, where the allocator exposes them."""
        counts = self.engine.checks.counts()
        return counts.free if counts else None

    def _refused(self, tracked: Tracked, branch: SeqId, tokens: Optional[int] = None) -> None:
        """Keep the refused admission of ``branch`` (``tokens`` long: by default its whole length) as a sample."""
        counts = self.engine.checks.counts()
        if tokens is None:
            tokens = (
                self.engine.expected.length(branch)
                if branch in self.engine.expected.seqs
                else len(tracked.request.prompt)
            )
        self.refusals.append(
            Refusal(
                self.step,
                tracked.request.id,
                tokens,
                -(-tokens // self.config.block_size),
                counts.free if counts else None,
                counts.cached if counts else None,
                len(self.running),
            )
        )
        if all(other is tracked for other in self.running):
            self.stalled.add(tracked.request.id)

    def _progressed(self, tracked: Tracked) -> None:
        """A branch of ``tracked`` started or grew: progress, and maybe a release (a sliding window drops blocks)."""
        self.progressed.add(tracked.request.id)
        self._released()

    def _released(self, after_step: bool = False) -> None:
        """Blocks may have been released now, in this round (``after_step``: after its step was launched).

        Step t completes when step t + W is launched, and a released block comes back once W more steps have
        completed: with n steps launched, the newest completed is L = max(-1, n - 1 - W), step L + W completes when
        step L + 2W is launched, so the block is back from round L + 2W + 1 (round n when W = 0)."""
        window = self.inflight_window
        launched = self.step + (1 if after_step else 0)
        self.settled_from = max(self.settled_from, max(-1, launched - 1 - window) + 2 * window + 1)

    def _reject_stalled(self) -> None:
        """Reject the requests that can never fit: refused in this round while no other request ran (and none runs
        at its end), with no progress (no branch started or grown), once every block released before has come back
        from its in-flight window. Nothing else holds blocks then, nothing is on its way back, and the request is
        where it was: it would be refused again in every later round."""
        settled = self.step >= self.settled_from
        for tracked in self.tracked:
            if (
                settled
                and tracked.request.id in self.stalled
                and tracked.request.id not in self.progressed
                and tracked.phase not in DONE
                and all(other is tracked for other in self.running)
            ):
                self._release(tracked)
                tracked.phase = Phase.REJECTED
        self.progressed.clear()
        self.stalled.clear()

    # -- the step ----------------------------------------------------------------------------------------------------

    def _run_step(self) -> None:
        self._reject_stalled()
        self.concurrency.append(len(self.running))
        self._before_step()
        self.engine.step()
        for tracked in list(self.running):
            for branch in tracked.live():
                if branch in self.scheduled and self._produces(branch):
                    tracked.produced[branch] += 1
                    if tracked.first_token_at is None:
                        tracked.first_token_at = self.step
                model = self.engine.expected.seqs.get(branch)
                if (
                    tracked.done(branch)
                    and model is not None
                    and model.status is Status.RUNNING
                    and not tracked.holds_for_forks(branch, self.fork)
                ):
                    self.engine.free(branch)
                    self._released(after_step=True)
            if len(tracked.produced) == len(tracked.branches) and all(map(tracked.done, tracked.branches)):
                tracked.phase, tracked.finished_at = Phase.FINISHED, self.step
                self.running.remove(tracked)
        self.scheduled.clear()
        self.preempted_this_round = False
        self.step += 1

    def _before_step(self) -> None:
        """Called once the round's work is scheduled, just before its step runs."""

    def _produces(self, branch: SeqId) -> bool:
        """Whether ``branch``'s work in this step produces a token (every scheduled branch does here; a chunk of a
        prompt before its last does not under a token budget)."""
        return True

    # -- the report --------------------------------------------------------------------------------------------------

    def _report(
        self, seconds: float, failure: Optional[str], quiescent: bool, undrained: Optional[str] = None
    ) -> ReplayReport:
        tracked = self.tracked
        ttft = [t.first_token_at - t.request.arrival + 1 for t in tracked if t.first_token_at is not None]
        tpot = [
            (t.finished_at - t.first_token_at) / (t.request.output_len - 1)
            for t in tracked
            if t.finished_at is not None and t.first_token_at is not None and t.request.output_len > 1
        ]
        return ReplayReport(
            self.workload.name,
            self.workload.origin,
            self.allocator_name,
            self.config.block_size,
            self.config.num_blocks,
            len(tracked),
            sum(t.admitted_at is not None for t in tracked),
            sum(t.phase is Phase.FINISHED for t in tracked),
            sum(t.phase is Phase.CANCELLED for t in tracked),
            sum(t.phase is Phase.CANCELLED and t.admitted_at is None for t in tracked),
            sum(t.phase is Phase.REJECTED for t in tracked),
            sum(t.preempted for t in tracked),
            sum(t.preempted > 0 for t in tracked),
            tuple(self.refusals),
            self.step,
            seconds,
            max(self.concurrency, default=0),
            sum(self.concurrency) / len(self.concurrency) if self.concurrency else 0.0,
            Latency.of(ttft),
            Latency.of(tpot),
            self.log.summary(),
            dict(sorted(self.engine.stats.items())),
            quiescent,
            failure,
            undrained,
        )


def replay_workload(
    workload: Workload,
    allocator: AllocatorProtocol,
    config: MachineConfig,
    allocator_name: str = "allocator",
    max_running: int = 256,
) -> ReplayReport:
    """Replay ``workload`` against ``allocator`` (built for ``config``'s pool) and report what happened."""
    return Scheduler(workload, allocator, config, allocator_name, max_running).run()
