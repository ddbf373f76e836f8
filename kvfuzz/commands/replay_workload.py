"""``kvfuzz replay-workload``: replay a request trace against an allocator, once or over a block-size sweep."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvfuzz.commands.account import parse_lengths
from kvfuzz.commands.json_stdout import emit_json
from kvfuzz.commands.options import at_least, needs_torch, progress
from kvfuzz.commands.output_files import OutputNotWritten, written_atomically
from kvfuzz.registry import DEFAULT_ALLOCATOR, AllocatorNotFound, load_factory, probe_allocator
from kvfuzz.workload.constructed import GENERATORS, constructed
from kvfuzz.workload.format import Workload, WorkloadError, load_workload
from kvfuzz.workload.sources import announce_large

if TYPE_CHECKING:
    from kvfuzz.engine.config import MachineConfig


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
    parser.add_argument("--block-size", type=at_least(1), default=16, help="slots per block (default 16)")
    parser.add_argument("--num-blocks", type=at_least(1), help="blocks in the pool (default: 768 positions' worth)")
    parser.add_argument(
        "--block-sizes",
        metavar="B,B,...",
        help="sweep: replay once per block size, each pool holding the same positions, side by side",
    )
    parser.add_argument(
        "--pool-positions",
        type=at_least(1),
        default=768,
        help="positions in the pool when --num-blocks is not given (default 768)",
    )
    parser.add_argument(
        "--max-running", type=at_least(1), default=256, help="most requests running at once (default 256)"
    )
    parser.add_argument("--plot", metavar="PNG", help="draw the occupancy over time (needs kvfuzz[plot])")
    parser.add_argument("--json", action="store_true", help="print the report(s) as JSON")
    parser.set_defaults(handler=needs_torch(run_command))


def _workload(source: str) -> Workload:
    if source.startswith("constructed:"):
        try:
            return constructed(source.split(":", 1)[1])
        except KeyError as error:
            raise WorkloadError(str(error.args[0])) from error
    announce_large(Path(source), progress)
    return load_workload(Path(source))


def _pools(args: argparse.Namespace) -> list[MachineConfig]:
    """The pool of each replay: one, or one per block size of a sweep, each holding the same positions."""
    from kvfuzz.engine.config import MachineConfig

    sizes = parse_lengths(args.block_sizes, "--block-sizes") if args.block_sizes else [args.block_size]
    if min(sizes) < 1:
        raise ValueError("--block-sizes: a block size must be >= 1")
    if args.block_sizes and args.num_blocks:
        raise ValueError("--num-blocks fixes one pool; a sweep sizes each pool from --pool-positions")
    uneven = [size for size in sizes if args.block_sizes and args.pool_positions % size]
    if uneven:
        raise ValueError(
            f"--pool-positions {args.pool_positions} is not a multiple of block size(s) {uneven}: "
            "the pools of a sweep must hold equal positions"
        )
    return [
        MachineConfig(
            block_size=size, num_blocks=args.num_blocks or max(1, args.pool_positions // size), num_host_blocks=0
        )
        for size in sizes
    ]


def run_command(args: argparse.Namespace) -> int:
    from kvfuzz.threads import single_threaded_torch
    from kvfuzz.workload.scheduler import ReplayError, Scheduler
    from kvfuzz.workload.sweep import sweep_table

    try:  # every check before any replay: the arguments, the workload, the plot's library, and each pool's allocator
        pools = _pools(args)
        workload = _workload(args.trace)
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib: pip install 'kvfuzz[plot]'")
        factory = load_factory(args.allocator)
        schedulers = [  # each refuses a workload its allocator cannot serve (namespaces it does not declare)
            Scheduler(
                workload,
                probe_allocator(args.allocator, factory, config.pool_spec()),
                config,
                args.allocator,
                args.max_running,
                progress=progress,  # on standard error: a long replay is seen moving
            )
            for config in pools
        ]
    except (WorkloadError, AllocatorNotFound, ReplayError, ValueError) as error:
        print(f"kvfuzz: {error}", file=sys.stderr)
        return 2
    with single_threaded_torch():
        reports = [scheduler.run() for scheduler in schedulers]
    undrained = next((report.undrained for report in reports if report.undrained), None)
    if undrained is not None and not any(report.failed for report in reports):  # a failure is reported first
        print(f"kvfuzz: {undrained}", file=sys.stderr)
        return 2
    if args.json:
        emit_json([report.to_json() for report in reports] if args.block_sizes else reports[0].to_json())
    else:
        for report in reports:
            print("\n".join(report.describe()) + "\n")
        if args.block_sizes:
            print("\n".join(sweep_table(reports)))
    if args.plot:
        from kvfuzz.workload.plot import PlotUnavailable, plot_occupancy

        try:  # the directory and matplotlib were checked up front; this is a write that failed all the same
            with written_atomically(Path(args.plot)) as picture:
                plot_occupancy(reports, picture)
        except (PlotUnavailable, OutputNotWritten) as error:
            print(f"kvfuzz: the occupancy plot was not written: {error}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"occupancy plot written to {args.plot}")
    return 1 if any(report.failed for report in reports) else 0
