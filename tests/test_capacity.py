"""Capacity at a latency target, the fixed-reservation allocator behind the contract, and the one-factor ablation."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from kvfuzz.allocator.errors import OutOfBlocks
from kvfuzz.allocator.reservation import ReservationAllocator, reservation_allocator
from kvfuzz.engine.config import MachineConfig
from kvfuzz.runner import run
from kvfuzz.workload.ablation import ablate, ablation_table, variants
from kvfuzz.workload.arrivals import ArrivalShape, poisson
from kvfuzz.workload.budget import Policy, ServingSettings
from kvfuzz.workload.capacity import Capacity, LatencyTarget, RatePoint, capacity_table, find_capacity
from kvfuzz.workload.layouts import paged, reservation
from kvfuzz.workload.provenance import MixedEvidence, Provenance

SHAPE = ArrivalShape(requests=10, system_prompt=16, own_prompt=(4, 24), output=(4, 16), samples_every=4)
POOL = 512  # positions: 8 reservations of 64, or 32 blocks of 16


# -- the reservation allocator ---------------------------------------------------------------------------------------


def test_a_reservation_holds_its_whole_region_from_admission_to_free() -> None:
    allocator = ReservationAllocator(block_size=64, num_blocks=2)
    assert allocator.admit("a", (), (1, 2, 3)).block_table == (0,)
    slots = allocator.grow("a", (4, 5)).slots
    assert [(slot.block, slot.offset) for slot in slots] == [(0, 3), (0, 4)]
    allocator.admit("b", (), (1,))
    with pytest.raises(OutOfBlocks):
        allocator.admit("c", (), (1,))
    assert allocator.refcount(0) == 1 and list(allocator.free_blocks()) == []
    allocator.free("a")
    assert list(allocator.free_blocks()) == [0]


def test_the_reservation_allocator_passes_kvfuzz() -> None:
    summary = run(reservation_allocator, MachineConfig(block_size=8, num_blocks=6, num_host_blocks=0), examples=15)
    assert not summary.failed, summary.failure


# -- capacity --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def capacities() -> list[Capacity]:
    settings, target = ServingSettings(token_budget=32), LatencyTarget(ttft_p99_steps=12, tpot_p99_steps=2)
    return [
        find_capacity(layout, [0.2, 0.5, 4.0, 8.0], 1, SHAPE, settings, target)
        for layout in (paged(16, POOL), reservation(64, POOL))
    ]


def test_capacity_is_the_last_rate_met_before_the_first_miss(capacities: list[Capacity]) -> None:
    paged_result, reserved = capacities
    for result in capacities:
        rates = [point.rate for point in result.points]
        assert rates == sorted(rates)
        assert all(point.miss is None for point in result.points[:-1])  # nothing is tried past the first miss
        assert all(not point.report.failed for point in result.points)
    assert paged_result.capacity is not None and reserved.capacity is not None
    # Eight reservations of 64 positions against 32 blocks of 16 in the same pool: the reservation queues requests
    # (it also recomputes each sample's prompt) at a rate that paging still serves within the target.
    assert reserved.first_miss is not None and reserved.first_miss.miss.startswith("p99 TTFT")
    assert paged_result.capacity >= reserved.first_miss.rate > reserved.capacity


def test_capacity_stops_at_a_miss_even_if_a_higher_rate_would_meet_the_target(capacities: list[Capacity]) -> None:
    report = capacities[0].points[0].report
    points = (
        RatePoint(0.1, report, None),
        RatePoint(0.2, report, "p99 TTFT 30 > 24 steps"),
        RatePoint(0.3, report, None),
    )
    result = Capacity(paged(16, POOL), points)
    assert result.capacity == 0.1 and result.first_miss is points[1]
    assert Capacity(paged(16, POOL), points[1:]).capacity is None


def test_the_target_names_what_a_rate_missed(capacities: list[Capacity]) -> None:
    report = capacities[0].points[0].report
    assert LatencyTarget(1000, 1000).miss(report) is None
    assert LatencyTarget(0.5, 1000).miss(report).startswith("p99 TTFT")
    assert LatencyTarget(1000, 0.5).miss(report).startswith("p99 TPOT")


def test_the_capacity_table_has_one_row_per_layout_and_refuses_mixed_evidence(capacities: list[Capacity]) -> None:
    target = LatencyTarget(ttft_p99_steps=12, tpot_p99_steps=2)
    table = capacity_table(capacities, target)
    assert "constructed workloads" in table[0] and "modelled, not measured" in table[0]
    assert [line.split()[0:2] for line in table[2:]] == [["paged", "B=16"], ["reserve", "64"]]
    point = capacities[1].points[0]
    recorded = attrs.evolve(point, report=attrs.evolve(point.report, provenance=Provenance("recorded", source="x")))
    mixed = [capacities[0], attrs.evolve(capacities[1], points=(recorded,))]
    with pytest.raises(MixedEvidence):
        capacity_table(mixed, target)


def test_the_capacity_plot_is_written(capacities: list[Capacity], tmp_path: Path) -> None:
    from kvfuzz.workload.plot import plot_capacity

    plot_capacity(capacities, LatencyTarget(), tmp_path / "capacity.png")
    assert (tmp_path / "capacity.png").read_bytes().startswith(b"\x89PNG")


# -- ablation --------------------------------------------------------------------------------------------------------


def test_each_ablation_row_differs_from_the_baseline_in_its_factor_alone() -> None:
    rows = variants(16, 64, POOL, ServingSettings())
    base = rows[0]
    assert [row.factor for row in rows] == ["baseline", "paging", "scheduling", "kernel", "prefix sharing"]
    changed = {
        row.factor: [
            name
            for name, a, b in (
                ("layout", row.layout.name, base.layout.name),
                ("block size", row.layout.block_size, base.layout.block_size),
                ("policy", row.settings.policy, base.settings.policy),
                ("budget", row.settings.token_budget, base.settings.token_budget),
                ("kernel", row.kernel, base.kernel),
            )
            if a != b
        ]
        for row in rows[1:]
    }
    assert changed == {
        "paging": ["layout", "block size"],
        "scheduling": ["policy"],
        "kernel": ["kernel"],
        "prefix sharing": ["layout"],
    }
    assert rows[2].settings.policy is Policy.PREFILL_FIRST and rows[3].kernel == "flex"


def test_the_ablation_table_splits_peak_memory_and_shows_what_each_factor_changes() -> None:
    small = attrs.evolve(SHAPE, requests=6)
    served = ablate(poisson(1.0, 2, small), variants(16, 64, POOL, ServingSettings(token_budget=32)))
    reports = {variant.factor: report for variant, report in served}
    assert all(not report.failed for report in reports.values())
    assert reports["baseline"].replay.operations.get("cache-hit tokens", 0) > 0
    assert reports["prefix sharing"].replay.operations.get("cache-hit tokens", 0) == 0
    assert reports["paging"].replay.block_size == 64 and "fork" not in reports["paging"].replay.operations
    assert reports["kernel"].steps == reports["baseline"].steps  # a kernel changes what is checked, not scheduling
    table = ablation_table(served)
    assert table[1].split()[:4] == ["factor", "setting", "carried", "TTFT"]
    assert all(line.rstrip().endswith("held") for line in table[2:])
    peak = reports["baseline"].replay.occupancy.peak
    assert f"{peak.effective_positions * 131072 / 2**20:.1f}" in table[2]  # K/V MiB at the peak step
    recorded = attrs.evolve(served[1][1], provenance=Provenance("recorded"))
    with pytest.raises(MixedEvidence):
        ablation_table([served[0], (served[1][0], recorded)])
