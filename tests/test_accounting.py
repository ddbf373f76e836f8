"""The paging arithmetic (exact worked example and identities) and live occupancy accounting."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfuzz.accounting import KVShape, ReservationTooSmall, account, measure, paged_layout, reserved_layout
from kvfuzz.allocator.types import NULL_BLOCK
from kvfuzz.cli import main
from kvfuzz.engine.config import MachineConfig
from kvfuzz.runner import run

WORKED_LENGTHS = [37, 91, 128, 201, 511]
SHAPE = KVShape(num_layers=32, num_kv_heads=8, head_dim=128, bytes_per_scalar=2)


def test_worked_example_comes_out_exactly():
    reserved, paged16, paged32 = account(WORKED_LENGTHS, [16, 32], SHAPE, reservation=512)
    assert [layout.valid_positions for layout in (reserved, paged16, paged32)] == [968, 968, 968]
    assert (reserved.allocated_positions, paged16.allocated_positions, paged32.allocated_positions) == (2560, 992, 1024)
    assert reserved.utilisation == Fraction(968, 2560)
    assert paged16.utilisation == Fraction(968, 992)
    assert paged32.utilisation == Fraction(968, 1024)
    assert [f"{float(layout.utilisation) * 100:.2f}%" for layout in (reserved, paged16, paged32)] == [
        "37.81%",
        "97.58%",
        "94.53%",
    ]
    assert reserved.tail_waste == 2560 - 968 and paged16.tail_waste == 24 and paged32.tail_waste == 56


def test_kv_bytes_follow_the_formula_and_tables_are_kept_apart():
    layout = paged_layout(WORKED_LENGTHS, 16, SHAPE, table_entry_bytes=4)
    assert layout.valid_kv_bytes == 2 * 32 * 968 * 8 * 128 * 2
    assert layout.allocated_kv_bytes == 2 * 32 * 992 * 8 * 128 * 2
    assert layout.table_entries == 3 + 6 + 8 + 13 + 32
    assert layout.table_bytes == 4 * layout.table_entries
    assert reserved_layout(WORKED_LENGTHS, 512, SHAPE).table_bytes == 0


def test_account_command_prints_the_worked_example(capsys):
    assert main(["account", "--lengths", "37,91,128,201,511", "--reserve", "512", "--block-sizes", "16,32"]) == 0
    rows = {
        line.split()[0] + line.split()[1]: line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith(("reserve", "paged"))
    }
    assert "2,560" in rows["reserve512"] and "37.81%" in rows["reserve512"]
    assert "992" in rows["pagedB=16"] and "97.58%" in rows["pagedB=16"]
    assert "1,024" in rows["pagedB=32"] and "94.53%" in rows["pagedB=32"]


def test_account_command_reads_a_file_and_prints_json(tmp_path, capsys):
    source = tmp_path / "lengths.txt"
    source.write_text("# one per line\n37\n91, 128\n201 511\n")
    assert main(["account", "--lengths-file", str(source), "--reserve", "512", "--block-sizes", "16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid_positions"] == 968
    assert [layout["allocated_positions"] for layout in report["layouts"]] == [2560, 992]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lengths", "37,x"], "item 2 is 'x'"),
        (["--lengths", "37,600", "--reserve", "512"], "cannot hold sequences of 600 tokens"),
        (["--lengths", "37", "--block-sizes", "0"], "block size must be >= 1"),
    ],
)
def test_account_command_refuses_bad_input_clearly(argv, message, capsys):
    assert main(["account", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_reservation_shorter_than_a_sequence_is_refused():
    with pytest.raises(ReservationTooSmall, match="600"):
        reserved_layout([10, 600], 512, SHAPE)


lengths_lists = st.lists(st.integers(0, 5000), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_lists, block_size=st.integers(1, 256))
def test_paged_identities(lengths, block_size):
    layout = paged_layout(lengths, block_size, SHAPE)
    # Counted independently, position by position: each sequence's last block leaves (-n) mod B slots unused.
    assert layout.tail_waste == sum((-length) % block_size for length in lengths)
    assert layout.valid_positions == sum(lengths)
    assert 0 <= layout.tail_waste <= len(lengths) * (block_size - 1)
    assert layout.allocated_positions % block_size == 0
    assert layout.utilisation <= 1
    reserved = reserved_layout(lengths, max(lengths), SHAPE)
    assert reserved.tail_waste == sum(max(lengths) - length for length in lengths)
    assert layout.allocated_positions <= reserved.allocated_positions + len(lengths) * (block_size - 1)


tables = st.lists(
    st.tuples(st.lists(st.sampled_from([NULL_BLOCK, *range(12)]), max_size=6), st.integers(0, 30)), max_size=6
)


@settings(max_examples=300, deadline=None)
@given(tables=tables, block_size=st.integers(1, 8))
def test_occupancy_identities(tables, block_size):
    occupancy = measure(0, tables, block_size, num_blocks=12)
    # Slots holding some sequence's token, counted one by one (a shared slot once).
    filled = {
        (table[position // block_size], position % block_size)
        for table, length in tables
        for position in range(min(length, len(table) * block_size))
        if table[position // block_size] != NULL_BLOCK
    }
    assert occupancy.effective_positions == len(filled)
    assert occupancy.saved_by_sharing >= 0
    assert 0 <= occupancy.tail_waste_positions
    assert occupancy.referenced_blocks == len({block for table, _ in tables for block in table if block != NULL_BLOCK})
    assert occupancy.table_entries == sum(len(table) for table, _ in tables)


def test_occupancy_counts_a_shared_block_once_with_its_fullest_fill():
    # Two sequences share block 3 (a prefix); one has written 4 slots of it, the other 2 slots of its own block 5.
    occupancy = measure(0, [((3, 5), 6), ((3,), 4)], block_size=4, num_blocks=8)
    assert (occupancy.referenced_blocks, occupancy.logical_blocks, occupancy.saved_by_sharing) == (2, 3, 1)
    assert (occupancy.effective_positions, occupancy.tail_waste_positions) == (6, 2)


def test_every_step_of_a_run_is_accounted_and_adds_up_to_the_pool():
    config = MachineConfig()
    from kvfuzz.allocator.paged import paged_allocator

    summary = run(paged_allocator, config, examples=20, steps=30)
    occupancy = summary.occupancy
    assert occupancy.samples == summary.operations["step"]
    assert occupancy.peak.referenced_blocks > 0
    for sample in occupancy.series:
        assert (
            sample.referenced_blocks + sample.cached_blocks + sample.free_blocks + sample.pending_blocks
            == sample.num_blocks
        )
        assert sample.num_blocks <= config.num_blocks  # the run's pool, or a smaller one its swarm drew
        assert sample.saved_by_sharing >= 0
    assert summary.to_json()["occupancy"]["peak"]["referenced_blocks"] == occupancy.peak.referenced_blocks
