"""A token-budget scheduler: at most ``token_budget`` tokens computed per step (vLLM's ``max_num_batched_tokens``),
prompts prefilled in chunks, and a policy that says whether decodes or prefills take the budget first.

Each round before step t, with the budget B:

1. start the branches running requests lack (readmit a preempted branch, fork a sample, or admit a sample beside the
   prompt where the allocator cannot fork), as the budget allows;
2. under ``decode-first``: grow every decoding branch by one token, then continue the prompts being prefilled by
   chunks of what is left, then admit waiting requests (preempted ones first) with a first chunk of their prompt;
   under ``prefill-first``: continue prefills, admit, and only then decode with what is left, so a long prompt
   delays the decodes of everything running;
3. cancel what the trace cancels, and abort every request not finished ``timeout_steps`` after its arrival;
4. run step t.

A prompt chunk is admitted (its first) or grown (the rest) with as many prompt tokens as the budget has left; a
cache hit costs nothing, so the budget it leaves goes to the next chunk at once. The step after a prompt's last
chunk produces the first output token. A preempted branch is readmitted with every token it had (the contract's
admit takes them at once): it is not chunked, and when it needs more than the budget it runs in a round whose
budget is untouched, the only step allowed past B. Every operation goes through the engine: every invariant is
checked, exactly as in :mod:`kvfuzz.workload.scheduler`, whose preemption, rejection and cancellation rules hold.
"""

from __future__ import annotations

import enum
import functools
from typing import Optional

import attrs

from kvfuzz.allocator.protocol import AllocatorProtocol
from kvfuzz.allocator.types import SeqId
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.expected import Status
from kvfuzz.workload.cost import CostModel, StepLoad, clock
from kvfuzz.workload.format import MAX_STEPS, Workload
from kvfuzz.workload.scheduler import DONE, Phase, ReplayError, Scheduler, Tracked
from kvfuzz.workload.serving_report import Distribution, Latencies, ServingReport, TimedOut


class Policy(enum.Enum):
    DECODE_FIRST = "decode-first"
    PREFILL_FIRST = "prefill-first"


POLICIES = tuple(policy.value for policy in Policy)


class BudgetScheduler(Scheduler):
    """Drives one workload through one engine under a per-step token budget; :meth:`serve` returns the report.

    ``prefilled[b]`` counts the prompt tokens branch b has handed to the allocator (the whole prompt for a fork);
    a branch decodes only once it equals the prompt's length."""

    def __init__(
        self,
        workload: Workload,
        allocator: AllocatorProtocol,
        config: MachineConfig,
        allocator_name: str,
        token_budget: int,
        policy: Policy = Policy.DECODE_FIRST,
        max_running: int = 256,
        timeout_steps: Optional[int] = None,
        cost: CostModel = CostModel(),
        max_steps: int = MAX_STEPS,
    ) -> None:
        super().__init__(workload, allocator, config, allocator_name, max_running, max_steps)
        if token_budget < 1:
            raise ReplayError(f"the token budget must be >= 1, got {token_budget}")
        if timeout_steps is not None and timeout_steps < 1:
            raise ReplayError(f"the timeout must be >= 1 step, got {timeout_steps}")
        self.token_budget, self.policy, self.timeout_steps, self.cost = token_budget, policy, timeout_steps, cost
        self.owner = {branch: tracked for tracked in self.tracked for branch in tracked.branches}
        self.prefilled: dict[SeqId, int] = {}
        self.loads: list[StepLoad] = []
        self.timeouts: list[TimedOut] = []

    # -- the budget ------------------------------------------------------------------------------------------------

    def _scheduled_tokens(self) -> int:
        """Tokens the next step computes: every running sequence's positions not yet written."""
        state = self.engine.expected
        return sum(state.length(seq) - state.seqs[seq].written for seq in state.ids(Status.RUNNING))

    def _budget_left(self) -> int:
        return self.token_budget - self._scheduled_tokens()

    def _affordable(self, tracked: Tracked, branch: SeqId) -> bool:
        """Whether the budget left can start ``branch``: a readmission needs all its tokens (or an untouched
        budget), a fork none, an admission one token for its first chunk."""
        left = self._budget_left()
        model = self.engine.expected.seqs.get(branch)
        if model is not None and model.status is Status.PREEMPTED:
            return self.engine.expected.length(branch) <= left or left == self.token_budget
        if branch != tracked.branches[0] and self.fork:
            return True
        return left >= 1

    def _prompt_done(self, branch: SeqId) -> bool:
        return self.prefilled.get(branch, 0) >= len(self.owner[branch].request.prompt)

    # -- one round ---------------------------------------------------------------------------------------------------

    def _schedule(self) -> None:
        self._start_branches()
        if self.policy is Policy.DECODE_FIRST:
            self._decode()
            self._prefill()
            self._admit()
        else:
            self._prefill()
            self._admit()
            self._decode()

    def _start(self, tracked: Tracked, branch: SeqId) -> bool:
        """Give ``branch`` blocks: readmit it, fork it from branch 0, or admit the first chunk of its prompt."""
        request, engine = tracked.request, self.engine
        model = engine.expected.seqs.get(branch)
        if model is not None and model.status is Status.PREEMPTED:
            tokens = engine.expected.length(branch)
            started = engine.readmit(branch)
        elif branch != tracked.branches[0] and self.fork:
            if not engine.fork(tracked.branches[0], branch):
                self._refused(tracked, branch, len(request.prompt))
                return False
            tracked.produced[branch] = 1  # its first token was sampled by the parent's prefill
            self.prefilled[branch] = len(request.prompt)
            self._progressed(tracked)
            return True
        else:
            tokens = min(len(request.prompt), max(1, self._budget_left()))
            started = engine.admit(branch, request.namespace, request.prompt[:tokens])
            if started:
                self.prefilled[branch] = tokens
        if not started:
            self._refused(tracked, branch, tokens)
            return False
        tracked.produced.setdefault(branch, 0)
        self.scheduled.add(branch)
        self._progressed(tracked)
        return True

    def _start_branches(self) -> None:
        for tracked in list(self.running):
            for branch in self._pending(tracked):
                if tracked not in self.running or not self._affordable(tracked, branch):
                    break
                if not self._with_room(tracked, functools.partial(self._start, tracked, branch)):
                    break
                self._prefill_branch(tracked, branch, make_room=True)

    def _prefill_branch(self, tracked: Tracked, branch: SeqId, make_room: bool) -> None:
        """Hand ``branch`` further chunks of its prompt while the budget lasts (``make_room``: preempting others
        when the pool is full, as a running request's growth does; else a refusal just ends it)."""
        prompt = tracked.request.prompt
        while not self._prompt_done(branch) and self._budget_left() > 0:
            model = self.engine.expected.seqs.get(branch)
            if model is None or model.status is not Status.RUNNING:
                return
            done = self.prefilled[branch]
            chunk = prompt[done : done + self._budget_left()]
            grow = functools.partial(self.engine.grow, branch, chunk)
            if not (self._with_room(tracked, grow) if make_room else grow()):
                return
            self.prefilled[branch] = done + len(chunk)
            self.scheduled.add(branch)
            self._progressed(tracked)

    def _prefill(self) -> None:
        """Continue the prompts of running requests, oldest admission first."""
        for tracked in list(self.running):
            for branch in tracked.live():
                if tracked not in self.running or self._budget_left() < 1:
                    break
                self._prefill_branch(tracked, branch, make_room=True)

    def _decode(self) -> None:
        """Grow every decoding branch by its next token while the budget lasts, oldest admission first."""
        for tracked in list(self.running):
            for branch in tracked.live():
                if tracked not in self.running or self._budget_left() < 1:
                    break
                model = self.engine.expected.seqs.get(branch)
                if (
                    model is None
                    or model.status is not Status.RUNNING
                    or not self._prompt_done(branch)
                    or tracked.done(branch)
                    or branch not in self.engine.expected.computed_ids()
                    or tracked.holds_for_forks(branch, self.fork)
                ):
                    continue
                token = tracked.request.output_token(tracked.branches.index(branch), tracked.produced[branch] - 1)
                if self._with_room(tracked, functools.partial(self.engine.grow, branch, (token,))):
                    self.scheduled.add(branch)
                    self._progressed(tracked)

    def _admit(self) -> None:
        """First come, first served (preempted requests first), while the budget and ``max_running`` allow; a
        refused admission ends the round's admissions."""
        if self.preempted_this_round:
            return
        while self.waiting and len(self.running) < self.max_running:
            tracked = self.waiting[0]
            pending = self._pending(tracked)
            started = 0
            for branch in pending:
                if not self._affordable(tracked, branch) or not self._start(tracked, branch):
                    break
                started += 1
                self._prefill_branch(tracked, branch, make_room=False)
            if not started:
                return
            self.waiting.pop(0)
            self.running.append(tracked)
            tracked.phase = Phase.RUNNING
            if tracked.admitted_at is None:
                tracked.admitted_at = self.step
            if started < len(pending):
                return

    def _cancel(self) -> None:
        super()._cancel()
        if self.timeout_steps is None:
            return
        for tracked in self.tracked:
            request = tracked.request
            if tracked.phase in DONE or request.arrival > self.step or self.step - request.arrival < self.timeout_steps:
                continue
            phase = "running" if tracked.phase is Phase.RUNNING else tracked.phase.value
            produced = tracked.produced.get(tracked.branches[0], 0)
            deadline = self.timeout_steps
            self.timeouts.append(
                TimedOut(self.step, request.id, request.arrival, deadline, phase, produced, request.output_len)
            )
            self._release(tracked)
            tracked.phase = Phase.TIMED_OUT

    def _before_step(self) -> None:
        state = self.engine.expected
        computed = [seq for seq in state.ids(Status.RUNNING) if state.length(seq) > state.seqs[seq].written]
        self.loads.append(StepLoad(self.step, self._scheduled_tokens(), sum(map(state.length, computed))))

    def _produces(self, branch: SeqId) -> bool:
        return self._prompt_done(branch)

    # -- the report --------------------------------------------------------------------------------------------------

    def serve(self) -> ServingReport:
        replay = self.run()
        starts = clock(self.loads, self.cost)
        in_steps: dict[str, list[float]] = {"ttft": [], "tpot": [], "e2e": []}
        in_seconds: dict[str, list[float]] = {"ttft": [], "tpot": [], "e2e": []}
        for tracked in self.tracked:
            arrival, first, last = tracked.request.arrival, tracked.first_token_at, tracked.finished_at
            if first is None:
                continue
            in_steps["ttft"].append(first - arrival + 1)
            in_seconds["ttft"].append(starts[first + 1] - starts[arrival])
            if last is None or tracked.phase is not Phase.FINISHED:
                continue
            in_steps["e2e"].append(last - arrival + 1)
            in_seconds["e2e"].append(starts[last + 1] - starts[arrival])
            if tracked.request.output_len > 1:
                tokens = tracked.request.output_len - 1
                in_steps["tpot"].append((last - first) / tokens)
                in_seconds["tpot"].append((starts[last + 1] - starts[first + 1]) / tokens)
        batched = [load.batched_tokens for load in self.loads]
        return ServingReport(
            replay,
            self.workload.source,
            self.policy.value,
            self.token_budget,
            self.config.kernel,
            self.timeout_steps,
            self.cost,
            _latencies(in_steps),
            _latencies(in_seconds),
            tuple(self.preemption_samples),
            tuple(self.timeouts),
            sum(batched) / len(batched) if batched else 0.0,
            max(batched, default=0),
            starts[-1],
        )


def _latencies(values: dict[str, list[float]]) -> Latencies:
    return Latencies(Distribution.of(values["ttft"]), Distribution.of(values["tpot"]), Distribution.of(values["e2e"]))


@attrs.frozen
class ServingSettings:
    """How a token-budget replay schedules: everything but the workload and the pool."""

    token_budget: int = attrs.field(default=64, validator=attrs.validators.ge(1))  # tokens computed per step
    policy: Policy = Policy.DECODE_FIRST  # which of decodes and prefills take the budget first
    max_running: int = attrs.field(default=256, validator=attrs.validators.ge(1))  # requests running at once
    timeout_steps: Optional[int] = None  # abort a request not finished this many steps after arriving
    cost: CostModel = CostModel()  # turns steps into modelled seconds

    def scheduler(
        self, workload: Workload, allocator: AllocatorProtocol, config: MachineConfig, allocator_name: str
    ) -> BudgetScheduler:
        return BudgetScheduler(
            workload,
            allocator,
            config,
            allocator_name,
            self.token_budget,
            self.policy,
            self.max_running,
            self.timeout_steps,
            self.cost,
        )
