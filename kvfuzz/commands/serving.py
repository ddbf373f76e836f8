"""``kvfuzz serve``, ``kvfuzz capacity`` and ``kvfuzz ablate``: the token-budget scheduler over one workload, the
highest Poisson arrival rate each pool layout serves within a latency target, and an ablation of one factor at a
time. Bad input is one line and exit status 2 before any replay."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from kvfuzz.commands.account import parse_lengths
from kvfuzz.commands.json_stdout import emit_json
from kvfuzz.commands.options import at_least, needs_torch, progress
from kvfuzz.commands.output_files import OutputNotWritten, written_atomically
from kvfuzz.option_defaults import KERNEL_NAMES, POLICY_NAMES
from kvfuzz.registry import DEFAULT_ALLOCATOR, AllocatorNotFound, load_factory, probe_allocator
from kvfuzz.workload.arrivals import ArrivalShape
from kvfuzz.workload.cost import CostModel
from kvfuzz.workload.format import WorkloadError, check_request_count
from kvfuzz.workload.sources import SOURCES_HELP, workload_from

if TYPE_CHECKING:
    from kvfuzz.workload.budget import ServingSettings
    from kvfuzz.workload.capacity import Capacity

DEFAULT_RATES = "0.1,0.2,0.3,0.4,0.5,0.6,0.8"


def _number(minimum: float, strict: bool) -> Callable[[str], float]:
    """An argparse ``type``: a number above ``minimum`` (``strict``) or at least it."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (value > minimum if strict else value >= minimum):  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {minimum:g}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def _scheduling(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scheduling and the cost model")
    group.add_argument("--token-budget", type=at_least(1), default=64, help="tokens computed per step (default 64)")
    group.add_argument("--policy", choices=POLICY_NAMES, default="decode-first", help="who takes the budget first")
    group.add_argument("--max-running", type=at_least(1), default=256, help="most requests running (default 256)")
    group.add_argument("--timeout", type=at_least(1), help="abort a request not finished this many steps after arrival")
    defaults = CostModel()
    group.add_argument("--step-ms", type=_number(0, False), default=defaults.fixed_s * 1e3, help="modelled ms per step")
    group.add_argument(
        "--token-us", type=_number(0, False), default=defaults.per_token_s * 1e6, help="modelled us per batched token"
    )
    group.add_argument(
        "--kv-us",
        type=_number(0, False),
        default=defaults.per_kv_position_s * 1e6,
        help="modelled us per K/V position read",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _settings(args: argparse.Namespace) -> ServingSettings:
    from kvfuzz.workload.budget import Policy, ServingSettings

    cost = CostModel(args.step_ms / 1e3, args.token_us / 1e6, args.kv_us / 1e6)
    return ServingSettings(args.token_budget, Policy(args.policy), args.max_running, args.timeout, cost)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="replay a workload under a per-step token budget (chunked prefill) and report latencies",
        description="Replay a workload under a per-step token budget with chunked prefill, every invariant "
        "checked, and report TTFT, TPOT and end-to-end latency in steps and in modelled seconds.",
    )
    serve.add_argument("trace", help=SOURCES_HELP)
    serve.add_argument("--allocator", default=DEFAULT_ALLOCATOR, help=f"MODULE:FACTORY (default {DEFAULT_ALLOCATOR})")
    serve.add_argument("--block-size", type=at_least(1), default=16, help="slots per block (default 16)")
    serve.add_argument("--pool-positions", type=at_least(1), default=1280, help="positions in the pool (default 1280)")
    serve.add_argument("--kernel", choices=KERNEL_NAMES, default="gather", help="attention kernel of invariant 2")
    serve.add_argument(
        "--step-seconds", type=_number(0, True), default=0.05, help="an imported trace's seconds per step"
    )
    serve.add_argument("--requests", type=at_least(1), default=60, help="requests of a poisson: workload")
    _scheduling(serve)
    serve.set_defaults(handler=needs_torch(run_serve))

    capacity = subparsers.add_parser(
        "capacity",
        help="the highest Poisson arrival rate each pool layout serves within a p99 latency target",
        description="Replay a seeded Poisson arrival process (constructed) at rising rates on paging with each "
        "block size and on a fixed per-request reservation, pools of equal positions, and report the highest rate "
        "whose p99 TTFT and TPOT meet the target.",
    )
    capacity.add_argument("--rates", default=DEFAULT_RATES, help=f"requests per step to try (default {DEFAULT_RATES})")
    capacity.add_argument("--seed", type=at_least(0), default=1, help="the arrival process's seed (default 1)")
    capacity.add_argument("--requests", type=at_least(1), default=40, help="requests per replay (default 40)")
    capacity.add_argument("--block-sizes", default="8,16,32,64", help="paged block sizes (default 8,16,32,64)")
    capacity.add_argument("--reserve", type=at_least(1), default=160, help="reservation per request (default 160)")
    capacity.add_argument("--pool-positions", type=at_least(1), default=1280, help="positions per pool (default 1280)")
    capacity.add_argument("--ttft-p99", type=_number(0, True), default=24.0, help="target p99 TTFT, steps (24)")
    capacity.add_argument("--tpot-p99", type=_number(0, True), default=2.0, help="target p99 TPOT, steps (2)")
    capacity.add_argument("--plot", metavar="PNG", help="draw p99 latency against rate (needs kvfuzz[plot])")
    _scheduling(capacity)
    capacity.set_defaults(handler=needs_torch(run_capacity))

    ablation = subparsers.add_parser(
        "ablate",
        help="serve one workload varying one factor at a time: paging, scheduling, kernel, prefix sharing",
        description="Serve one workload from a baseline (paged, decode-first, gather kernel, prefix sharing on) "
        "and with each factor varied alone; one table of requests carried, latencies and peak memory.",
    )
    ablation.add_argument("trace", nargs="?", default="poisson:0.5:1", help=f"{SOURCES_HELP} (default poisson:0.5:1)")
    ablation.add_argument("--block-size", type=at_least(1), default=16, help="paged block size (default 16)")
    ablation.add_argument("--reserve", type=at_least(1), default=160, help="reservation per request (default 160)")
    ablation.add_argument("--pool-positions", type=at_least(1), default=1280, help="positions per pool (default 1280)")
    ablation.add_argument("--step-seconds", type=_number(0, True), default=0.05, help="an imported trace's s/step")
    ablation.add_argument("--requests", type=at_least(1), default=40, help="requests of a poisson: workload (40)")
    _scheduling(ablation)
    ablation.set_defaults(handler=needs_torch(run_ablate))


def _refuse(error: Exception) -> int:
    print(f"kvfuzz: {error}", file=sys.stderr)
    return 2


def run_serve(args: argparse.Namespace) -> int:
    from kvfuzz.engine.config import MachineConfig
    from kvfuzz.kernels import make_kernel, prepare_kernel
    from kvfuzz.threads import single_threaded_torch
    from kvfuzz.workload.scheduler import ReplayError

    try:
        if args.pool_positions % args.block_size:
            raise ValueError(f"--pool-positions {args.pool_positions} is not a multiple of --block-size")
        workload = workload_from(args.trace, args.step_seconds, args.requests, progress)
        config = MachineConfig(args.block_size, args.pool_positions // args.block_size, 0, kernel=args.kernel)
        prepare_kernel(config.kernel, config.shape)  # before the allocator's package, and so its engine, loads
        allocator = probe_allocator(args.allocator, load_factory(args.allocator), config.pool_spec())
        make_kernel(config.kernel, allocator, config.shape)  # a kernel that cannot run here: refused before work
        scheduler = _settings(args).scheduler(workload, allocator, config, args.allocator)
    except (WorkloadError, AllocatorNotFound, ReplayError, ValueError) as error:
        return _refuse(error)
    scheduler.progress = progress  # on standard error: a long replay is seen moving
    with single_threaded_torch():
        report = scheduler.serve()
    if report.replay.undrained is not None and not report.failed:  # a failure is reported first
        return _refuse(ValueError(report.replay.undrained))
    if args.json:
        emit_json(report.to_json())
    else:
        print("\n".join(report.describe()))
    return 1 if report.failed else 0


def _rates(text: str) -> list[float]:
    rates = []
    for word in text.split(","):
        try:
            rate = float(word)
        except ValueError:
            raise ValueError(f"--rates: {word!r} is not a number") from None
        if not rate > 0:
            raise ValueError(f"--rates: a rate must be > 0 requests per step, got {word}")
        rates.append(rate)
    return rates


def run_capacity(args: argparse.Namespace) -> int:
    from kvfuzz.threads import single_threaded_torch
    from kvfuzz.workload.capacity import LatencyTarget, capacity_table, find_capacity
    from kvfuzz.workload.layouts import paged, reservation

    try:
        rates = _rates(args.rates)
        sizes = parse_lengths(args.block_sizes, "--block-sizes")
        if 0 in sizes:
            raise ValueError("--block-sizes: a block size must be >= 1")
        check_request_count(args.requests, "--requests")
        shape = ArrivalShape(requests=args.requests)
        if args.reserve < shape.longest():
            raise ValueError(
                f"--reserve {args.reserve} is shorter than the longest request ({shape.longest()} positions)"
            )
        uneven = [size for size in [*sizes, args.reserve] if args.pool_positions % size]
        if uneven:
            raise ValueError(f"--pool-positions {args.pool_positions} is not a multiple of {uneven}")
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib: pip install 'kvfuzz[plot]'")
        settings, target = _settings(args), LatencyTarget(args.ttft_p99, args.tpot_p99)
    except ValueError as error:  # WorkloadError included
        return _refuse(error)
    layouts = [paged(size, args.pool_positions) for size in sizes] + [reservation(args.reserve, args.pool_positions)]
    with single_threaded_torch():
        results = [
            find_capacity(layout, rates, args.seed, shape, settings, target, progress=progress) for layout in layouts
        ]
    if args.json:
        emit_json([_capacity_json(result) for result in results])
    else:
        print(settings.cost.describe())
        print(f"scheduling: {settings.policy.value}, token budget {settings.token_budget} per step")
        print("\n".join(capacity_table(results, target)))
    if args.plot:
        from kvfuzz.workload.plot import PlotUnavailable, plot_capacity

        try:
            with written_atomically(Path(args.plot)) as picture:
                plot_capacity(results, target, picture)
        except (PlotUnavailable, OutputNotWritten) as error:
            print(f"kvfuzz: the capacity plot was not written: {error}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"capacity plot written to {args.plot}")
    return 1 if any(point.report.failed for result in results for point in result.points) else 0


def _capacity_json(result: Capacity) -> dict:
    return {
        "layout": result.layout.label,
        "allocator": result.layout.name,
        "block_size": result.layout.block_size,
        "pool_positions": result.layout.pool_positions,
        "capacity": result.capacity,
        "points": [
            {"rate": point.rate, "miss": point.miss, "report": point.report.to_json()} for point in result.points
        ],
    }


def run_ablate(args: argparse.Namespace) -> int:
    from kvfuzz.threads import single_threaded_torch
    from kvfuzz.workload.ablation import ablate, ablation_table, variants
    from kvfuzz.workload.provenance import MixedEvidence

    try:
        workload = workload_from(args.trace, args.step_seconds, args.requests, progress)
        longest = max(len(request.prompt) + request.output_len for request in workload.requests)
        if args.reserve < longest:
            raise ValueError(f"--reserve {args.reserve} is shorter than the longest request ({longest} positions)")
        uneven = [size for size in (args.block_size, args.reserve) if args.pool_positions % size]
        if uneven:
            raise ValueError(f"--pool-positions {args.pool_positions} is not a multiple of {uneven}")
        rows = variants(args.block_size, args.reserve, args.pool_positions, _settings(args))
    except (WorkloadError, ValueError) as error:
        return _refuse(error)
    with single_threaded_torch():
        served = ablate(workload, rows, progress)
    if args.json:
        emit_json([{"factor": v.factor, "setting": v.setting, **r.to_json()} for v, r in served])
    else:
        print(f"workload {workload.name}: {workload.source.describe()}")
        print(rows[0].settings.cost.describe())
        try:
            print("\n".join(ablation_table(served)))
        except MixedEvidence as error:  # one workload has one kind; kept for the rule's sake
            return _refuse(error)
    return 1 if any(report.failed for _, report in served) else 0
