"""A block-size sweep over one workload, side by side: the same trace, pools of equal positions."""

from __future__ import annotations

from typing import Sequence

from kvfuzz.workload.report import ReplayReport


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def sweep_table(reports: Sequence[ReplayReport]) -> list[str]:
    """One column per replay. Utilisation is mean effective K/V positions over mean referenced positions."""
    rows: list[tuple[str, list[object]]] = [
        ("block size", [r.block_size for r in reports]),
        ("pool blocks", [r.num_blocks for r in reports]),
        ("pool positions", [r.num_blocks * r.block_size for r in reports]),
        ("steps", [r.steps for r in reports]),
        ("finished", [r.finished for r in reports]),
        ("refused admissions", [len(r.refusals) for r in reports]),
        ("preemptions", [r.preemptions for r in reports]),
        ("peak concurrency", [r.peak_concurrency for r in reports]),
        ("mean concurrency", [r.mean_concurrency for r in reports]),
        (
            "peak referenced positions",
            [r.occupancy.peak.referenced_blocks * r.block_size if r.occupancy.peak else 0 for r in reports],
        ),
        ("mean K/V positions", [r.occupancy.mean.get("effective_positions") for r in reports]),
        ("mean tail waste", [r.occupancy.mean.get("tail_waste_positions") for r in reports]),
        ("mean utilisation", [_utilisation(r) for r in reports]),
        ("mean blocks saved by sharing", [r.occupancy.mean.get("saved_by_sharing") for r in reports]),
        ("mean table entries", [r.occupancy.mean.get("table_entries") for r in reports]),
        (
            "TTFT p50 / p99 (steps)",
            [f"{_fmt(r.time_to_first_token.p50)} / {_fmt(r.time_to_first_token.p99)}" for r in reports],
        ),
        (
            "TPOT p50 / p99 (steps)",
            [f"{_fmt(r.time_per_output_token.p50)} / {_fmt(r.time_per_output_token.p99)}" for r in reports],
        ),
        ("invariants", ["FAILED" if r.failed else "held" for r in reports]),
    ]
    cells = [(label, [_fmt(value) for value in values]) for label, values in rows]
    label_width = max(len(label) for label, _ in cells)
    widths = [max(len(values[column]) for _, values in cells) for column in range(len(reports))]
    return [
        f"{label:<{label_width}}  " + "  ".join(value.rjust(width) for value, width in zip(values, widths))
        for label, values in cells
    ]


def _utilisation(report: ReplayReport) -> object:
    mean = report.occupancy.mean
    if not mean.get("referenced_blocks"):
        return None
    return f"{100 * mean['effective_positions'] / (mean['referenced_blocks'] * report.block_size):.2f}%"
