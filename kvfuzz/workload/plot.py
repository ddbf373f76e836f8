"""PNGs for people who would rather look than read (need matplotlib): the pool's occupancy over time, and the
latency-against-rate curves of a capacity search."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from kvfuzz.workload.report import ReplayReport

if TYPE_CHECKING:
    from kvfuzz.workload.capacity import Capacity, LatencyTarget


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def plot_occupancy(reports: Sequence[ReplayReport], path: Path) -> None:
    """One panel per replay: positions of K/V, tail waste and cached-but-free blocks stacked under the pool size,
    and the blocks sharing saves, per step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise PlotUnavailable("the plot needs matplotlib: pip install 'kvfuzz[plot]'") from error
    figure, axes = plt.subplots(len(reports), 1, figsize=(10, 3.2 * len(reports)), squeeze=False, sharex=True)
    for axis, report in zip(axes[:, 0], reports):
        series = report.occupancy.series
        steps = [sample.step for sample in series]
        size = report.block_size
        effective = [sample.effective_positions for sample in series]
        waste = [sample.tail_waste_positions for sample in series]
        cached = [(sample.cached_blocks or 0) * size for sample in series]
        axis.stackplot(
            steps,
            effective,
            waste,
            cached,
            labels=("K/V of live tokens", "tail waste", "cached, unreferenced"),
            colors=("#3b75af", "#ef8636", "#9bbb59"),
            alpha=0.85,
        )
        axis.plot(
            steps,
            [sample.saved_by_sharing * size for sample in series],
            color="black",
            linewidth=1,
            label="saved by sharing",
        )
        axis.axhline(report.num_blocks * size, color="grey", linestyle="--", linewidth=1, label="pool size")
        axis.set_ylabel("positions")
        axis.set_title(
            f"{report.workload} ({report.origin}) on {report.allocator}: {report.num_blocks} blocks x {size}",
            fontsize=9,
        )
        axis.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_capacity(results: "Sequence[Capacity]", target: "LatencyTarget", path: Path) -> None:
    """p99 time to first token and p99 time per output token against the arrival rate, one line per layout, with
    the target as a dashed line: a layout's capacity is the last rate of its line under both."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise PlotUnavailable("the plot needs matplotlib: pip install 'kvfuzz[plot]'") from error
    figure, (ttft_axis, tpot_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for result in results:
        rates = [point.rate for point in result.points]
        steps = [point.report.steps for point in result.points]
        ttft_axis.plot(rates, [s.time_to_first_token.p99 for s in steps], marker="o", label=result.layout.label)
        tpot_axis.plot(rates, [s.time_per_output_token.p99 for s in steps], marker="o", label=result.layout.label)
    ttft_axis.axhline(target.ttft_p99_steps, color="grey", linestyle="--", linewidth=1, label="target")
    tpot_axis.axhline(target.tpot_p99_steps, color="grey", linestyle="--", linewidth=1, label="target")
    ttft_axis.set_ylabel("p99 time to first token (steps)")
    tpot_axis.set_ylabel("p99 time per output token (steps)")
    for axis in (ttft_axis, tpot_axis):
        axis.set_xlabel("arrival rate (requests per step, Poisson, constructed)")
        axis.legend(fontsize=7)
    figure.suptitle("capacity at a latency target: each line stops at the first rate that missed it", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
