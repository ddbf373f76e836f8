"""``kvfuzz zoo``: the machine against every broken allocator in the zoo, one Markdown row per variant."""

from __future__ import annotations

import argparse
import sys

from kvfuzz.commands.json_stdout import emit_json
from kvfuzz.commands.options import machine_arguments, machine_config, needs_torch, progress
from kvfuzz.registry import AllocatorNotFound, probe_allocator

ZOO_EXAMPLES = 2000
"""Each variant's budget unless ``--examples`` says otherwise: the test suite's, and enough for every variant that is
not deep. Measured (the derandomized run of each): the latest, ``FullHitCappedInPlace`` and ``EvictsOnRefusal``,
first fail at examples 435 and 684, among the random programs of the budget's first half; a budget of 600 (300
random programs) let ``FullHitCappedInPlace`` escape. A variant that is caught stops at its first failure, so the
budget costs only the variants that escape."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("zoo", help="run the machine against every broken allocator in the zoo")
    parser.add_argument("--only", nargs="+", default=(), metavar="NAME", help="run only these variants")
    parser.add_argument(
        "--deep",
        action="store_true",
        help="also run the deep variants, which a run of this length usually misses (campaigns are for them)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as one JSON list")
    machine_arguments(parser, examples=ZOO_EXAMPLES)
    parser.set_defaults(handler=needs_torch(run_command))


def run_command(args: argparse.Namespace) -> int:
    from kvfuzz.zoo import VARIANTS
    from kvfuzz.zoo_run import ZooResult, markdown_header, markdown_row, run_zoo

    unknown = set(args.only) - {variant.name for variant in VARIANTS}
    try:
        config = machine_config(args)
        if unknown:
            raise ValueError(
                f"no zoo variant named {', '.join(sorted(unknown))}; known: {', '.join(v.name for v in VARIANTS)}"
            )
        selected = [
            variant
            for variant in VARIANTS
            if variant.name in args.only or not args.only and (args.deep or not variant.deep)
        ]
        for variant in selected:  # each builds for this pool before any runs
            probe_allocator(f"zoo:{variant.name}", variant.factory(), config.pool_spec())
    except (AllocatorNotFound, ValueError) as error:
        print(f"kvfuzz: {error}", file=sys.stderr)
        return 2
    if not args.json:
        print(markdown_header(), flush=True)
    done: list[ZooResult] = []

    def on_result(result: ZooResult) -> None:  # a row on standard output as it comes; with --json, progress lines
        done.append(result)
        if args.json:
            verdict = "caught as expected" if result.caught_as_expected else "NOT caught as expected"
            progress(f"zoo: {result.variant.name} {verdict} ({len(done)} of {len(selected)})")
        else:
            print(markdown_row(result.row()), flush=True)

    results = run_zoo(
        config,
        examples=args.examples,
        steps=args.steps,
        seed=args.seed,
        shrink=not args.no_shrink,
        names=args.only,
        deep=args.deep,
        on_result=on_result,
    )
    if args.json:
        emit_json([result.to_json() for result in results])
    else:
        caught = sum(result.caught_as_expected for result in results)
        print(
            f"\n{caught} of {len(results)} variant{'' if len(results) == 1 else 's'} caught by the expected invariant"
        )
    return 0 if all(result.caught_as_expected for result in results) else 1
