"""The ``kvfuzz`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import attrs
from hypothesis.database import DirectoryBasedExampleDatabase

from kvfuzz.accounting import command as account_command
from kvfuzz.corpus import export_test, replay_trace, save_failure
from kvfuzz.kernels import KERNEL_NAMES, make_kernel
from kvfuzz.reference.content import ModelShape
from kvfuzz.registry import DEFAULT_ALLOCATOR, AllocatorNotFound, load_factory
from kvfuzz.runner import RunSummary, run
from kvfuzz.statemachines.config import MachineConfig
from kvfuzz.statemachines.minimize import NotApplicable
from kvfuzz.trace import DTYPES, TraceError
from kvfuzz.trace import load as load_trace
from kvfuzz.workload import command as workload_command


def _machine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("machine")
    group.add_argument("--examples", type=int, default=100, help="Hypothesis examples to run (default 100)")
    group.add_argument("--steps", type=int, default=50, help="most operations per example (default 50)")
    group.add_argument("--seed", type=int, help="random seed (default: derandomized, the same run every time)")
    group.add_argument("--no-shrink", action="store_true", help="report the first failure as found, unshrunk")
    pool = parser.add_argument_group("pool and model")
    pool.add_argument("--block-size", type=int, default=MachineConfig().block_size)
    pool.add_argument("--num-blocks", type=int, default=MachineConfig().num_blocks)
    pool.add_argument("--host-blocks", type=int, default=MachineConfig().num_host_blocks)
    pool.add_argument("--layers", type=int, default=ModelShape().num_layers)
    pool.add_argument("--kv-heads", type=int, default=ModelShape().num_kv_heads)
    pool.add_argument("--query-heads", type=int, default=ModelShape().num_query_heads)
    pool.add_argument("--head-dim", type=int, default=ModelShape().head_dim)
    pool.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    pool.add_argument("--device", default="cpu", help="torch device of the pools: cpu (default), cuda, cuda:N")


def _config(args: argparse.Namespace) -> MachineConfig:
    shape = ModelShape(args.layers, args.kv_heads, args.query_heads, args.head_dim, DTYPES[args.dtype], args.device)
    return MachineConfig(args.block_size, args.num_blocks, args.host_blocks, shape)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfuzz", description="Fuzz-test a paged KV-cache allocator.")
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run the machine against an allocator")
    run_parser.add_argument(
        "--allocator",
        default=DEFAULT_ALLOCATOR,
        help=f"MODULE:FACTORY called with a PoolSpec (default {DEFAULT_ALLOCATOR}); "
        "zoo:NAME for a broken allocator from kvfuzz's zoo",
    )
    run_parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    run_parser.add_argument(
        "--corpus", default="corpus", metavar="DIR", help="where a failure's trace is saved (default: corpus)"
    )
    run_parser.add_argument(
        "--database",
        metavar="DIR",
        help="Hypothesis example database: failing examples are saved there and tried first "
        "by the next run (share it between CI runs); makes the run random, not seeded",
    )
    run_parser.add_argument(
        "--kernel",
        choices=KERNEL_NAMES,
        default="gather",
        help="attention kernel of invariant 2: gather (the reference's, bitwise; default), "
        "flex (FlexAttention over the paged pools, eager, within a tolerance), allocator "
        "(the allocator's own paged attention, if it declares one); saved in traces",
    )
    _machine_arguments(run_parser)
    replay_parser = commands.add_parser("replay", help="re-execute saved traces, without Hypothesis")
    replay_parser.add_argument("traces", nargs="+", metavar="FILE")
    replay_parser.add_argument("--allocator", help="replay against this allocator instead of the recorded one")
    export_parser = commands.add_parser("export", help="write a trace as a standalone pytest file")
    export_parser.add_argument("trace", metavar="FILE")
    export_parser.add_argument("--allocator", help="test this allocator instead of the recorded one")
    export_parser.add_argument("-o", "--output", help="the file to write (default: stdout)")
    zoo_parser = commands.add_parser("zoo", help="run the machine against every broken allocator in the zoo")
    zoo_parser.add_argument("--only", nargs="+", default=(), metavar="NAME", help="run only these variants")
    zoo_parser.add_argument("--json", action="store_true", help="print the results as one JSON list")
    _machine_arguments(zoo_parser)
    zoo_parser.set_defaults(examples=600)
    account_command.add_parser(commands)
    workload_command.add_parser(commands)
    return parser


def _print_summary(summary: RunSummary, config: MachineConfig) -> None:
    verdict = "FAILED" if summary.failed else "passed"
    print(
        f"{verdict}: {summary.examples} examples, {summary.steps} steps in {summary.seconds:.1f} s "
        f"({summary.steps_per_second:.0f} steps/s)"
    )
    print("operations:")
    width = max((len(name) for name in summary.operations), default=0)
    for name, count in summary.operations.items():
        print(f"  {name:<{width}}  {count}")
    if summary.occupancy is not None:
        print("\n".join(summary.occupancy.describe()))
    if summary.failed:
        first = (
            f" (first failing example: #{summary.first_failure_examples}, after {summary.first_failure_seconds:.2f} s)"
            if summary.first_failure_seconds is not None
            else ""
        )
        print(
            f"\n{summary.invariant}{first}\n\n{'shrunk' if summary.shrunk else 'failing'} program "
            f"({summary.program_length} operations):"
        )
        print(summary.program or "  (no program was printed)")
        print(f"\n{summary.explanation}")


def _run(args: argparse.Namespace) -> int:
    try:
        config = attrs.evolve(_config(args), kernel=args.kernel)
        factory = load_factory(args.allocator)
        probe = factory(config.pool_spec())  # never driven: checks the kernel, later gives the declared window
        make_kernel(config.kernel, probe)
    except (AllocatorNotFound, ValueError) as error:
        print(f"kvfuzz: {error}", file=sys.stderr)
        return 2
    progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    if not args.json:
        shape = config.shape
        print(
            f"kvfuzz run: {args.allocator}\n  pool: {config.num_blocks} blocks x {config.block_size} slots, "
            f"{config.num_host_blocks} host blocks; model: {shape.num_layers} layers, {shape.num_kv_heads} KV / "
            f"{shape.num_query_heads} query heads, head dim {shape.head_dim}, {args.dtype} on {shape.device}, "
            f"{config.kernel} attention kernel\n"
            f"  {args.examples} examples of up to {args.steps} steps, "
            f"{'seed ' + str(args.seed) if args.seed is not None else 'derandomized'}",
            flush=True,
        )
    database = DirectoryBasedExampleDatabase(args.database) if args.database else None
    if database is not None and args.seed is not None:
        print(
            "kvfuzz: --seed and --database cannot be combined (Hypothesis ignores the database under a seed)",
            file=sys.stderr,
        )
        return 2
    summary = run(
        factory,
        config,
        examples=args.examples,
        steps=args.steps,
        seed=args.seed,
        allocator_name=args.allocator,
        shrink=not args.no_shrink,
        database=database,
        progress=progress,
    )
    saved = None
    if summary.failed:
        saved = save_failure(summary, args.allocator, config, probe.capabilities.inflight_window, Path(args.corpus))
    if args.json:
        print(json.dumps({**summary.to_json(), "trace": str(saved[0]) if saved else None}, indent=2))
    else:
        _print_summary(summary, config)
        if saved:
            print(
                f"\ntrace {'saved to' if saved[1] else 'already in the corpus:'} {saved[0]}"
                f"\nreplay it with: kvfuzz replay {saved[0]}"
            )
    return 1 if summary.failed else 0


def _replay(args: argparse.Namespace) -> int:
    worst = 0
    for path in args.traces:
        try:
            trace = load_trace(Path(path))
            print(
                f"{path}: recorded against {trace.allocator}: {trace.failure.get('title')}"
                + (f" (known bug: {trace.known_bug})" if trace.known_bug else "")
            )
            replayed = replay_trace(
                trace, args.allocator, on_call=lambda index, call: print(f"  {index + 1:3}  {call}")
            )
        except (TraceError, AllocatorNotFound, NotApplicable) as error:
            print(f"kvfuzz: {error}", file=sys.stderr)
            worst = max(worst, 2)
            continue
        failed_at = replayed.outcome.failed_at
        if not replayed.failed:
            print(f"  ok   replayed against {replayed.allocator}: the failure no longer reproduces\n")
            continue
        where = "teardown" if failed_at == len(trace.program) else f"call {failed_at + 1}"
        verdict = "REPRODUCED" if replayed.reproduced else "FAILED DIFFERENTLY"
        print(
            f"  >>   {verdict} at {where} against {replayed.allocator}:\n"
            + "\n".join(f"       {line}" for line in replayed.describe_failure().splitlines())
            + "\n"
        )
        worst = max(worst, 1)
    return worst


def _export(args: argparse.Namespace) -> int:
    try:
        trace = load_trace(Path(args.trace))
    except TraceError as error:
        print(f"kvfuzz: {error}", file=sys.stderr)
        return 2
    text = export_test(trace, args.trace, args.allocator)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}; run it with: pytest {args.output}")
    else:
        print(text, end="")
    return 0


def _zoo(args: argparse.Namespace) -> int:
    from kvfuzz.zoo import VARIANTS
    from kvfuzz.zoo.report import markdown_header, markdown_row, run_zoo

    try:
        config = _config(args)
    except ValueError as error:
        print(f"kvfuzz: {error}", file=sys.stderr)
        return 2
    unknown = set(args.only) - {variant.name for variant in VARIANTS}
    if unknown:
        print(f"kvfuzz: no zoo variant named {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    if not args.json:
        print(markdown_header(), flush=True)
    results = run_zoo(
        config,
        examples=args.examples,
        steps=args.steps,
        seed=args.seed,
        shrink=not args.no_shrink,
        names=args.only,
        on_result=None if args.json else lambda result: print(markdown_row(result.row()), flush=True),
    )
    if args.json:
        print(json.dumps([result.to_json() for result in results], indent=2))
    else:
        caught = sum(result.caught_as_expected for result in results)
        print(f"\n{caught} of {len(results)} variants caught by the expected invariant")
    return 0 if all(result.caught_as_expected for result in results) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if hasattr(args, "handler"):
        return args.handler(args)
    return {"run": _run, "zoo": _zoo, "replay": _replay, "export": _export}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
