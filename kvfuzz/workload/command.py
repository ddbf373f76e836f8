"""``kvfuzz replay-workload``: replay a request trace against an allocator, once or over a block-size sweep."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvfuzz.accounting.command import parse_lengths
from kvfuzz.engine.config import MachineConfig
from kvfuzz.registry import DEFAULT_ALLOCATOR, AllocatorNotFound, load_factory
from kvfuzz.runner import single_threaded_torch
from kvfuzz.workload.constructed import GENERATORS, constructed
from kvfuzz.workload.format import Workload, WorkloadError, load_workload
from kvfuzz.workload.report import ReplayReport
from kvfuzz.workload.scheduler import ReplayError, replay_workload
from kvfuzz.workload.sweep import sweep_table


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "replay-workload",
        help="replay a continuous-batching request trace against an allocator",
        description="Run a continuous-batching scheduler over a request trace against an allocator, with every "
        "kvfuzz invariant checked, and report admissions, refusals, preemptions, latency in steps and "
        "the pool's occupancy over time.",
    )
    parser.add_argument("trace", help=f"a kvfuzz-workload/1 JSON file, or constructed:NAME ({', '.join(GENERATORS)})")
    parser.add_argument("--allocator", default=DEFAULT_ALLOCATOR, help=f"MODULE:FACTORY (default {DEFAULT_ALLOCATOR})")
    parser.add_argument("--block-size", type=int, default=16, help="slots per block (default 16)")
    parser.add_argument("--num-blocks", type=int, help="blocks in the pool (default: 768 positions' worth)")
    parser.add_argument(
        "--block-sizes",
        metavar="B,B,...",
        help="sweep: replay once per block size, each pool holding the same positions, side by side",
    )
    parser.add_argument(
        "--pool-positions",
        type=int,
        default=768,
        help="positions in the pool when --num-blocks is not given (default 768)",
    )
    parser.add_argument("--max-running", type=int, default=256, help="most requests running at once (default 256)")
    parser.add_argument("--plot", metavar="PNG", help="draw the occupancy over time (needs kvfuzz[plot])")
    parser.add_argument("--json", action="store_true", help="print the report(s) as JSON")
    parser.set_defaults(handler=run_command)


def _workload(source: str) -> Workload:
    if source.startswith("constructed:"):
        try:
            return constructed(source.split(":", 1)[1])
        except KeyError as error:
            raise WorkloadError(str(error.args[0])) from error
    return load_workload(Path(source))


def _replay(workload: Workload, allocator: str, block_size: int, num_blocks: int, max_running: int) -> ReplayReport:
    config = MachineConfig(block_size=block_size, num_blocks=num_blocks, num_host_blocks=0)
    factory = load_factory(allocator)
    with single_threaded_torch():
        return replay_workload(workload, factory(config.pool_spec()), config, allocator, max_running)


def run_command(args: argparse.Namespace) -> int:
    try:
        workload = _workload(args.trace)
        sizes = parse_lengths(args.block_sizes, "--block-sizes") if args.block_sizes else [args.block_size]
        if min(sizes) < 1:
            raise ValueError("block sizes must be >= 1")
        if args.block_sizes and args.num_blocks:
            raise ValueError("--num-blocks fixes one pool; a sweep sizes each pool from --pool-positions")
        uneven = [size for size in sizes if args.block_sizes and args.pool_positions % size]
        if uneven:
            raise ValueError(
                f"--pool-positions {args.pool_positions} is not a multiple of block size(s) {uneven}: "
                "the pools of a sweep must hold equal positions"
            )
        if args.max_running < 1:
            raise ValueError(f"--max-running must be >= 1, got {args.max_running}")
        reports = [
            _replay(
                workload, args.allocator, size, args.num_blocks or max(1, args.pool_positions // size), args.max_running
            )
            for size in sizes
        ]
    except (WorkloadError, AllocatorNotFound, ReplayError, ValueError) as error:
        print(f"kvfuzz replay-workload: {error}", file=sys.stderr)
        return 2
    if args.plot:
        from kvfuzz.workload.plot import PlotUnavailable, plot_occupancy

        try:
            plot_occupancy(reports, Path(args.plot))
        except PlotUnavailable as error:
            print(f"kvfuzz replay-workload: {error}", file=sys.stderr)
            return 2
    if args.json:
        print(
            json.dumps([report.to_json() for report in reports] if args.block_sizes else reports[0].to_json(), indent=2)
        )
    else:
        for report in reports:
            print("\n".join(report.describe()) + "\n")
        if args.block_sizes:
            print("\n".join(sweep_table(reports)))
        if args.plot:
            print(f"occupancy plot written to {args.plot}")
    return 1 if any(report.failed for report in reports) else 0
