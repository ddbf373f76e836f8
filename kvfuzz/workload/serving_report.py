"""What a token-budget replay served: latency distributions in steps and in modelled seconds, and every preemption
and timeout kept as a sample, beside the replay's own report (admissions, refusals, occupancy)."""

from __future__ import annotations

from typing import Optional, Sequence

import attrs

from kvfuzz.text import plural
from kvfuzz.workload.cost import CostModel
from kvfuzz.workload.provenance import Provenance
from kvfuzz.workload.report import Preemption, ReplayReport, percentile


@attrs.frozen
class Distribution:
    """p50, p90, p99 (nearest rank) and the maximum of one latency over ``count`` requests (None when no request
    has it)."""

    count: int
    p50: Optional[float]
    p90: Optional[float]
    p99: Optional[float]
    max: Optional[float]

    @classmethod
    def of(cls, values: Sequence[float]) -> "Distribution":
        p50, p90, p99 = (percentile(values, pct) for pct in (50, 90, 99))
        return cls(len(values), p50, p90, p99, max(values, default=None))

    def cells(self, digits: int) -> list[str]:
        return ["-" if value is None else f"{value:.{digits}f}" for value in (self.p50, self.p90, self.p99, self.max)]


@attrs.frozen
class TimedOut:
    """A request aborted because it was not finished ``deadline`` steps after arriving (as a client gives up)."""

    step: int  # the round in which it was aborted
    request: str  # its id
    arrival: int  # its arrival step
    deadline: int  # the timeout, in steps after arrival
    phase: str  # where it was: waiting for admission, preempted, or running
    produced: int  # output tokens its first branch had produced
    output_len: int  # output tokens it asked for

    def describe(self) -> str:
        return (
            f"step {self.step}: {self.request} (arrived at step {self.arrival}) timed out after {self.deadline} steps "
            f"while {self.phase}, {self.produced} of {self.output_len} output tokens produced"
        )


@attrs.frozen
class Latencies:
    """Time to first token, time per output token and end-to-end latency of the requests that have them: TTFT and
    end-to-end count from arrival to the end of the step that produced the first (last) token; TPOT is the time
    between first and last token over the tokens after the first."""

    time_to_first_token: Distribution
    time_per_output_token: Distribution
    end_to_end: Distribution

    def rows(self) -> list[tuple[str, Distribution]]:
        return [("TTFT", self.time_to_first_token), ("TPOT", self.time_per_output_token), ("E2E", self.end_to_end)]


@attrs.frozen
class ServingReport:
    """A replay under a per-step token budget (:mod:`kvfuzz.workload.budget`): the replay's report, the scheduling
    settings, the latencies in steps and in seconds of the declared cost model, and every preemption and timeout."""

    replay: ReplayReport  # admissions, refusals (each kept), occupancy, invariants
    provenance: Provenance  # where the workload came from
    policy: str  # decode-first or prefill-first
    token_budget: int  # most tokens computed in one step (a preempted request's recomputation may run alone past it)
    kernel: str  # the attention kernel invariant 2 ran
    timeout_steps: Optional[int]  # the end-to-end deadline after arrival, or None
    cost: CostModel  # the declared per-step cost model
    steps: Latencies  # latencies in steps
    seconds: Latencies  # latencies in modelled seconds
    preemptions: tuple[Preemption, ...]  # every preemption
    timeouts: tuple[TimedOut, ...]  # every request that timed out
    mean_batched_tokens: float  # tokens computed per step, on average
    peak_batched_tokens: int  # the most tokens computed in one step
    modelled_seconds: float  # the whole replay's modelled time

    @property
    def failed(self) -> bool:
        return self.replay.failed

    def to_json(self) -> dict:
        return {
            "replay": self.replay.to_json(),
            "provenance": self.provenance.to_json(),
            "policy": self.policy,
            "token_budget": self.token_budget,
            "kernel": self.kernel,
            "timeout_steps": self.timeout_steps,
            "cost_model": self.cost.to_json(),
            "latency_steps": attrs.asdict(self.steps),
            "latency_modelled_seconds": attrs.asdict(self.seconds),
            "preemptions": [attrs.asdict(sample) for sample in self.preemptions],
            "timeouts": [attrs.asdict(sample) for sample in self.timeouts],
            "mean_batched_tokens": self.mean_batched_tokens,
            "peak_batched_tokens": self.peak_batched_tokens,
            "modelled_seconds": self.modelled_seconds,
        }

    def latency_table(self) -> list[str]:
        header = f"    {'latency':<22}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}  requests"
        lines = [header]
        for unit, latencies, digits in (("steps", self.steps, 2), ("s, modelled", self.seconds, 3)):
            for name, distribution in latencies.rows():
                cells = "".join(f"{cell:>9}" for cell in distribution.cells(digits))
                lines.append(f"    {f'{name} ({unit})':<22}{cells}  {distribution.count}")
        return lines

    def describe(self, samples: int = 5) -> list[str]:
        replay = self.replay.describe(samples, latency=False)
        failure = replay[-2:] if self.replay.failure else []  # a blank line and the failure, kept last
        replay = replay[: len(replay) - len(failure)]
        deadline = f", timeout {self.timeout_steps} steps after arrival" if self.timeout_steps is not None else ""
        lines = [
            replay[0],
            f"  provenance: {self.provenance.describe()}",
            f"  scheduling: {self.policy}, token budget {self.token_budget} per step (chunked prefill), "
            f"kernel {self.kernel}{deadline}",
            *replay[1:],
            f"  batched tokens per step: mean {self.mean_batched_tokens:.1f}, peak {self.peak_batched_tokens}",
            f"  {self.cost.describe()}; the replay takes {self.modelled_seconds:.3f} modelled seconds",
            "  latency (nearest rank):",
            *self.latency_table(),
            f"  preemptions: {len(self.preemptions)} (each kept)",
            *[f"    {sample.describe()}" for sample in self.preemptions[:samples]],
            *([f"    ... {len(self.preemptions) - samples} more"] if len(self.preemptions) > samples else []),
            f"  timed out: {plural(len(self.timeouts), 'request')} (each kept)",
            *[f"    {sample.describe()}" for sample in self.timeouts[:samples]],
            *([f"    ... {len(self.timeouts) - samples} more"] if len(self.timeouts) > samples else []),
        ]
        return lines + failure
