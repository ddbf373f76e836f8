"""``kvfuzz account``: the paging arithmetic over a block-size sweep against a fixed reservation, as a table."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from kvfuzz.accounting.arithmetic import KVShape, Layout, account
from kvfuzz.commands.json_stdout import emit_json
from kvfuzz.commands.options import at_least

BYTES_PER_SCALAR = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
DEFAULT_BLOCK_SIZES = (8, 16, 32, 64)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "account",
        help="positions, tail waste, utilisation and bytes of paging vs a fixed reservation",
        description="Exact accounting of a set of sequence lengths: a fixed per-sequence reservation against paging "
        "with each block size. K/V bytes (2·L·n·h_kv·d_h·b) and block-table bytes are kept apart.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--lengths", help="comma-separated sequence lengths, e.g. 37,91,128,201,511")
    source.add_argument(
        "--lengths-file",
        metavar="FILE",
        help="a file of lengths separated by spaces, commas or newlines ('#' starts a comment)",
    )
    parser.add_argument(
        "--block-sizes",
        default=",".join(map(str, DEFAULT_BLOCK_SIZES)),
        help="comma-separated block sizes to sweep (default 8,16,32,64)",
    )
    parser.add_argument(
        "--reserve",
        type=at_least(1),
        metavar="M",
        help="positions a fixed reservation gives each sequence (default: the longest length)",
    )
    parser.add_argument("--layers", type=at_least(1), default=32, help="L (default 32)")
    parser.add_argument("--kv-heads", type=at_least(1), default=8, help="h_kv (default 8)")
    parser.add_argument("--head-dim", type=at_least(1), default=128, help="d_h (default 128)")
    parser.add_argument(
        "--dtype",
        choices=sorted(BYTES_PER_SCALAR),
        default="bfloat16",
        help="b, the bytes per scalar (default bfloat16: 2)",
    )
    parser.add_argument(
        "--table-entry-bytes", type=at_least(1), default=4, help="bytes per block-table entry (default 4, an int32)"
    )
    parser.add_argument("--json", action="store_true", help="print the layouts as one JSON object")
    parser.set_defaults(handler=run_command)


def parse_lengths(text: str, where: str) -> list[int]:
    """Lengths from free text: integers separated by commas or whitespace; '#' comments are ignored."""
    words = [word for line in text.splitlines() for word in re.split(r"[,\s]+", line.split("#")[0]) if word]
    lengths = []
    for number, word in enumerate(words, start=1):
        if not word.isdigit():
            raise ValueError(f"{where}: item {number} is {word!r}, not a non-negative integer length")
        lengths.append(int(word))
    if not lengths:
        raise ValueError(f"{where}: no lengths given")
    return lengths


def _block_sizes(text: str) -> list[int]:
    sizes = parse_lengths(text, "--block-sizes")
    if 0 in sizes:
        raise ValueError("--block-sizes: a block size must be >= 1")
    return sizes


def _mib(value: int) -> str:
    return f"{value / 2**20:,.2f} MiB"


def format_table(layouts: list[Layout]) -> list[str]:
    """One row per layout; utilisation rounded to two decimals, bytes in MiB."""
    header = (
        "layout",
        "valid",
        "allocated",
        "tail waste",
        "utilisation",
        "K/V valid",
        "K/V allocated",
        "table entries",
        "table bytes",
    )
    rows = [
        (
            layout.label,
            f"{layout.valid_positions:,}",
            f"{layout.allocated_positions:,}",
            f"{layout.tail_waste:,}",
            f"{float(layout.utilisation) * 100:.2f}%",
            _mib(layout.valid_kv_bytes),
            _mib(layout.allocated_kv_bytes),
            f"{layout.table_entries:,}",
            f"{layout.table_bytes:,}",
        )
        for layout in layouts
    ]
    widths = [max(len(row[column]) for row in (header, *rows)) for column in range(len(header))]
    return [
        "  ".join(
            cell.ljust(width) if column == 0 else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths))
        )
        for row in (header, *rows)
    ]


def run_command(args: argparse.Namespace) -> int:
    try:
        lengths = (
            parse_lengths(args.lengths, "--lengths")
            if args.lengths is not None
            else parse_lengths(Path(args.lengths_file).read_text(), args.lengths_file)
        )
        shape = KVShape(args.layers, args.kv_heads, args.head_dim, BYTES_PER_SCALAR[args.dtype])
        layouts = account(lengths, _block_sizes(args.block_sizes), shape, args.reserve, args.table_entry_bytes)
    except (OSError, ValueError) as error:
        print(f"kvfuzz: {error}", file=sys.stderr)
        return 2
    if args.json:
        emit_json(
            {
                "lengths": len(lengths),
                "valid_positions": sum(lengths),
                "kv_bytes_per_position": shape.kv_bytes(1),
                "layouts": [layout.to_json() for layout in layouts],
            }
        )
        return 0
    print(f"kvfuzz account: {len(lengths)} sequences, {sum(lengths):,} valid positions (longest {max(lengths):,})")
    print(f"  model: {shape.describe()} ({args.dtype})")
    print(
        f"  block tables: {args.table_entry_bytes} bytes per entry, one table per sequence for all layers; "
        "the reservation keeps none"
    )
    print("  K/V bytes exclude block tables, workspace and padding; utilisation is valid / allocated positions\n")
    print("\n".join(format_table(layouts)))
    return 0
