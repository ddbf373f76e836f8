"""Capacity at a latency target: the highest arrival rate a pool layout serves while its p99 latencies stay within
a stated target.

For each layout, the seeded Poisson process (:mod:`kvfuzz.workload.arrivals`, constructed) is replayed under the
token-budget scheduler at each rate of a grid, lowest first, until a rate misses the target; the capacity is the
last rate that met it (rates beyond the first miss are not tried, so the capacity is never a lucky rate past a
failing one). A rate meets the target when the replay held every invariant, every request finished (none rejected
or timed out), and p99 time to first token and p99 time per output token, in steps, are within the target. Rates
are requests per step; the modelled seconds of the cost model are shown beside the steps.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import attrs

from kvfuzz.workload.arrivals import ArrivalShape, poisson
from kvfuzz.workload.budget import ServingSettings
from kvfuzz.workload.layouts import PoolLayout
from kvfuzz.workload.provenance import one_kind
from kvfuzz.workload.serving_report import ServingReport


@attrs.frozen
class LatencyTarget:
    """p99 time to first token and p99 time per output token, in steps, that a rate must not exceed."""

    ttft_p99_steps: float = attrs.field(default=24.0, validator=attrs.validators.gt(0))  # p99 TTFT bound
    tpot_p99_steps: float = attrs.field(default=2.0, validator=attrs.validators.gt(0))  # p99 TPOT bound

    def describe(self) -> str:
        return f"p99 TTFT <= {self.ttft_p99_steps:g} steps and p99 TPOT <= {self.tpot_p99_steps:g} steps"

    def miss(self, report: ServingReport) -> Optional[str]:
        """Why ``report`` misses the target, or None when it meets it."""
        replay = report.replay
        if replay.failed:
            return "an invariant broke"
        if replay.finished < replay.requests:
            return f"{replay.requests - replay.finished} of {replay.requests} requests not finished"
        ttft, tpot = report.steps.time_to_first_token.p99, report.steps.time_per_output_token.p99
        if ttft is not None and ttft > self.ttft_p99_steps:
            return f"p99 TTFT {ttft:g} > {self.ttft_p99_steps:g} steps"
        if tpot is not None and tpot > self.tpot_p99_steps:
            return f"p99 TPOT {tpot:.2f} > {self.tpot_p99_steps:g} steps"
        return None


@attrs.frozen
class RatePoint:
    """One replay of the arrival process at ``rate`` requests per step; ``miss`` says why it missed the target."""

    rate: float  # requests per step
    report: ServingReport  # what the replay served
    miss: Optional[str]  # None when the target was met


@attrs.frozen
class Capacity:
    """The rates tried for one layout, lowest first, up to and including the first miss; ``capacity`` is the last
    rate met before it (None when the lowest rate already missed)."""

    layout: PoolLayout
    points: tuple[RatePoint, ...]

    @property
    def capacity(self) -> Optional[float]:
        met = None
        for point in self.points:
            if point.miss is not None:
                break
            met = point.rate
        return met

    @property
    def at_capacity(self) -> Optional[RatePoint]:
        return next((point for point in self.points if point.rate == self.capacity), None)

    @property
    def first_miss(self) -> Optional[RatePoint]:
        return next((point for point in self.points if point.miss is not None), None)


def find_capacity(
    layout: PoolLayout,
    rates: Sequence[float],
    seed: int,
    shape: ArrivalShape,
    settings: ServingSettings,
    target: LatencyTarget,
    kernel: str = "gather",
    progress: Optional[Callable[[str], None]] = None,
) -> Capacity:
    """Replay the arrival process on ``layout`` at each rate, lowest first, until one misses ``target``; each replay
    is announced to ``progress`` as it starts."""
    points = []
    for rate in sorted(rates):
        if progress is not None:
            progress(f"{layout.label}: replaying {shape.requests} requests at {rate:g} per step")
        config = layout.config(kernel)
        report = settings.scheduler(poisson(rate, seed, shape), layout.factory(config.pool_spec()), config, layout.name)
        served = report.serve()
        points.append(RatePoint(rate, served, target.miss(served)))
        if points[-1].miss is not None:
            break
    return Capacity(layout, tuple(points))


def _cell(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def capacity_table(results: Sequence[Capacity], target: LatencyTarget) -> list[str]:
    """One row per layout: its capacity, the latencies and pool use at that rate, and why the next rate missed.
    Refuses (:class:`~kvfuzz.workload.provenance.MixedEvidence`) runs of constructed and recorded workloads."""
    kind = one_kind((point.report.provenance for r in results for point in r.points), "capacity table")
    header = (
        "layout",
        "pool",
        "capacity",
        "p99 TTFT",
        "p99 TPOT",
        "p99 E2E",
        "p99 E2E s",
        "peak running",
        "preemptions",
        "next rate missed because",
    )
    rows = []
    for result in results:
        point, miss = result.at_capacity, result.first_miss
        report = point.report if point is not None else None
        steps = report.steps if report is not None else None
        rows.append(
            (
                result.layout.label,
                f"{result.layout.pool_positions // result.layout.block_size} x {result.layout.block_size}",
                _cell(result.capacity, 2),
                _cell(steps.time_to_first_token.p99 if steps else None, 0),
                _cell(steps.time_per_output_token.p99 if steps else None, 2),
                _cell(steps.end_to_end.p99 if steps else None, 0),
                _cell(report.seconds.end_to_end.p99 if report else None, 3),
                str(report.replay.peak_concurrency) if report else "-",
                str(report.replay.preemptions) if report else "-",
                f"{miss.rate:g}: {miss.miss}" if miss is not None else "none missed",
            )
        )
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(width) if column in (0, len(row) - 1) else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths))
        ).rstrip()

    return [
        f"capacity at {target.describe()} ({kind} workloads; rates in requests per step; latencies in steps, "
        "E2E s modelled, not measured)",
        line(header),
        *map(line, rows),
    ]
