"""What one workload replay did: request outcomes, concurrency, latency in steps, refusals, and occupancy."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import attrs

from kvfuzz.accounting.occupancy import OccupancySummary
from kvfuzz.text import plural


def percentile(values: Sequence[float], pct: float) -> Optional[float]:
    """Nearest-rank percentile: the smallest value with at least ``pct`` percent of the values at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


@attrs.frozen
class Refusal:
    """An admission the allocator refused for lack of blocks; the request stayed queued (or, when it could never
    fit, was rejected)."""

    step: int
    request: str
    tokens: int
    blocks_needed: int
    free_blocks: Optional[int]
    cached_blocks: Optional[int]
    running_requests: int

    def describe(self) -> str:
        pool = (
            ""
            if self.free_blocks is None
            else f"; pool had {self.free_blocks} free and {self.cached_blocks} cached-but-free blocks"
        )
        return (
            f"step {self.step}: {self.request} ({self.tokens} tokens, {self.blocks_needed} blocks without cache "
            f"hits) refused with {plural(self.running_requests, 'request')} running{pool}"
        )


@attrs.frozen
class Preemption:
    """A request preempted for recomputation: at which step, which request, for which one (the request that
    needed room; the victim itself when it outgrew the pool among others), and the free blocks left then."""

    step: int
    victim: str
    for_request: str
    free_blocks: Optional[int]

    def describe(self) -> str:
        pool = "" if self.free_blocks is None else f" ({plural(self.free_blocks, 'free block')} left)"
        return f"step {self.step}: {self.victim} preempted for recomputation: {self.for_request} needed room{pool}"


@attrs.frozen
class Latency:
    """p50 and p99 (nearest rank) of a latency measured in engine steps, over ``count`` requests."""

    count: int
    p50: Optional[float]
    p99: Optional[float]

    @classmethod
    def of(cls, values: Sequence[float]) -> "Latency":
        return cls(len(values), percentile(values, 50), percentile(values, 99))

    def describe(self) -> str:
        if not self.count:
            return "n/a"
        return f"p50 {self.p50:.2f}, p99 {self.p99:.2f} steps (over {plural(self.count, 'request')})"


@attrs.frozen
class ReplayReport:
    """One replay of a workload against one allocator and pool.

    ``admitted`` counts requests admitted at least once; ``rejected`` those refused while nothing else ran (they
    could never fit); ``refusals`` keeps every refused admission. Time to first token counts the steps from arrival
    to the end of the step that produced the first token (1 when admitted and prefilled on arrival); time per
    output token is the steps between first and last token over the tokens after the first.
    """

    workload: str
    origin: str
    allocator: str
    block_size: int
    num_blocks: int
    requests: int
    admitted: int
    finished: int
    cancelled: int
    cancelled_before_admission: int
    rejected: int
    preemptions: int
    preempted_requests: int
    refusals: tuple[Refusal, ...]
    steps: int
    seconds: float
    peak_concurrency: int
    mean_concurrency: float
    time_to_first_token: Latency
    time_per_output_token: Latency
    occupancy: OccupancySummary
    operations: dict
    quiescent: bool
    failure: Optional[str] = None
    undrained: Optional[str] = None  # why the replay stopped at its step limit (no failure: the workload is too long)

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def to_json(self) -> dict:
        fields = attrs.asdict(self, recurse=False)
        fields["refusals"] = [attrs.asdict(refusal) for refusal in self.refusals]
        fields["time_to_first_token"] = attrs.asdict(self.time_to_first_token)
        fields["time_per_output_token"] = attrs.asdict(self.time_per_output_token)
        fields["occupancy"] = self.occupancy.to_json()
        return fields

    def describe(self, samples: int = 5, latency: bool = True) -> list[str]:
        """The report for a person; ``latency`` False leaves out the two latency lines (a serving report prints its
        own, fuller ones)."""
        latency_lines = [
            f"  time to first token: {self.time_to_first_token.describe()}",
            f"  time per output token: {self.time_per_output_token.describe()}",
        ]
        lines = [
            f"workload {self.workload} ({self.origin}), {plural(self.requests, 'request')}, against {self.allocator}",
            f"  pool: {plural(self.num_blocks, 'block')} x {plural(self.block_size, 'slot')}",
            f"  {'FAILED' if self.failed else 'did not drain' if self.undrained else 'passed'}: {self.steps} steps in "
            f"{self.seconds:.1f} s, "
            "every invariant checked after every operation"
            + ("; every block free at the end" if self.quiescent else ""),
            f"  requests: {self.admitted} admitted, {self.finished} finished, {self.cancelled} cancelled "
            f"({self.cancelled_before_admission} before admission), {self.rejected} rejected (never fit), "
            f"{plural(self.preemptions, 'preemption')} of {plural(self.preempted_requests, 'request')}",
            f"  refused admissions: {len(self.refusals)} (each kept; the request waited and retried)",
            *[f"    {refusal.describe()}" for refusal in self.refusals[:samples]],
            *([f"    ... {len(self.refusals) - samples} more"] if len(self.refusals) > samples else []),
            f"  concurrency: peak {self.peak_concurrency}, mean {self.mean_concurrency:.2f} running requests",
            *(latency_lines if latency else []),
            *["  " + line for line in self.occupancy.describe()],
        ]
        if self.failure:
            lines += ["", self.failure]
        if self.undrained:
            lines += ["", self.undrained]
        return lines
