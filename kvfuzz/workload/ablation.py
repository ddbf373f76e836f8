"""Ablation: one workload served with each factor varied alone from a baseline (paged, decode-first, the gather
kernel, prefix sharing on): paging against a fixed reservation, prefill-first scheduling, the flex kernel, and
the prefix cache off. One row per variant: requests carried, latencies, and the peak memory split.

Memory is converted to bytes with a declared model shape (:class:`~kvfuzz.accounting.arithmetic.KVShape`, by default
32 layers x 8 KV heads x head dim 128 in bfloat16, as ``kvfuzz account``), at the step with the most referenced
blocks: effective K/V (positions holding a live token), tail fragmentation (the rest of the referenced blocks), block
tables (4 bytes per entry; a reservation's one entry per sequence is its base pointer), and the reserved pool.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import attrs

from kvfuzz.accounting.arithmetic import KVShape
from kvfuzz.workload.budget import Policy, ServingSettings
from kvfuzz.workload.format import Workload
from kvfuzz.workload.layouts import PoolLayout, paged, reservation
from kvfuzz.workload.provenance import one_kind
from kvfuzz.workload.serving_report import ServingReport

MODEL = KVShape(32, 8, 128, 2)
TABLE_ENTRY_BYTES = 4


@attrs.frozen
class Variant:
    """One row of the ablation: the factor varied (``baseline`` for none) and what it was set to."""

    factor: str  # the factor varied from the baseline
    setting: str  # its value in this row
    layout: PoolLayout  # the pool and allocator
    settings: ServingSettings  # the scheduling
    kernel: str  # the attention kernel invariant 2 runs


def variants(block_size: int, reserve: int, pool_positions: int, settings: ServingSettings) -> list[Variant]:
    """The baseline and one row per factor, each differing from the baseline in that factor alone."""
    base = paged(block_size, pool_positions)
    prefill_first = attrs.evolve(settings, policy=Policy.PREFILL_FIRST)
    return [
        Variant("baseline", f"{base.label}, {settings.policy.value}, gather, sharing on", base, settings, "gather"),
        Variant(
            "paging",
            reservation(reserve, pool_positions).label,
            reservation(reserve, pool_positions),
            settings,
            "gather",
        ),
        Variant("scheduling", Policy.PREFILL_FIRST.value, base, prefill_first, "gather"),
        Variant("kernel", "flex", base, settings, "flex"),
        Variant("prefix sharing", "off", paged(block_size, pool_positions, sharing=False), settings, "gather"),
    ]


def ablate(
    workload: Workload, rows: Sequence[Variant], progress: Optional[Callable[[str], None]] = None
) -> list[tuple[Variant, ServingReport]]:
    """Serve ``workload`` once per variant; each is announced to ``progress`` as it starts."""
    served = []
    for number, variant in enumerate(rows, start=1):
        if progress is not None:
            progress(f"serving {variant.factor} = {variant.setting} ({number} of {len(rows)})")
        config = variant.layout.config(variant.kernel)
        allocator = variant.layout.factory(config.pool_spec())
        served.append((variant, variant.settings.scheduler(workload, allocator, config, variant.layout.name).serve()))
    return served


def _mib(positions: int) -> str:
    return f"{MODEL.kv_bytes(positions) / 2**20:.1f}"


def ablation_table(served: Sequence[tuple[Variant, ServingReport]]) -> list[str]:
    """The rows side by side; refuses (:class:`~kvfuzz.workload.provenance.MixedEvidence`) a mix of constructed
    and recorded workloads."""
    kind = one_kind((report.provenance for _, report in served), "ablation table")
    header = (
        "factor",
        "setting",
        "carried",
        "TTFT p50/p99",
        "TPOT p99",
        "E2E p99",
        "E2E p99 s",
        "preempt",
        "K/V MiB",
        "tail MiB",
        "tables KiB",
        "pool MiB",
        "invariants",
    )
    rows = []
    for variant, report in served:
        replay, steps = report.replay, report.steps
        peak = replay.occupancy.peak
        ttft = steps.time_to_first_token
        rows.append(
            (
                variant.factor,
                variant.setting,
                f"{replay.finished}/{replay.requests}",
                "-" if ttft.p50 is None else f"{ttft.p50:g}/{ttft.p99:g}",
                "-" if steps.time_per_output_token.p99 is None else f"{steps.time_per_output_token.p99:.2f}",
                "-" if steps.end_to_end.p99 is None else f"{steps.end_to_end.p99:g}",
                "-" if report.seconds.end_to_end.p99 is None else f"{report.seconds.end_to_end.p99:.3f}",
                str(replay.preemptions),
                _mib(peak.effective_positions) if peak else "-",
                _mib(peak.tail_waste_positions) if peak else "-",
                f"{peak.table_entries * TABLE_ENTRY_BYTES / 1024:.2f}" if peak else "-",
                _mib(replay.num_blocks * replay.block_size),
                "FAILED" if replay.failed else "held",
            )
        )
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(width) if column < 2 else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths))
        ).rstrip()

    return [
        f"ablation ({kind} workload; latencies in steps, E2E s modelled, not measured; memory at the peak step, "
        f"{MODEL.describe()})",
        line(header),
        *map(line, rows),
    ]
