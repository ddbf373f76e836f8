"""How fast kvfuzz finds each zoo variant, and what each part of its search adds.

For every variant and several seeds, in one run, three searches with the same checks and the same budget:

* kvfuzz: what ``kvfuzz run`` does: random programs for the first half of the budget, then Hypothesis's machine,
  and the failure shrunk (by Hypothesis where it found it, then by deleting calls on replay);
* Hypothesis only: the machine alone (swarm of enabled rules, Hypothesis's shrinking, then kvfuzz's);
* random only: the baseline a user might write instead: random programs of the same lengths, no Hypothesis and
  no shrinking (its "length" is the failing program's).

Per variant: how many runs the expected invariant caught, the median and worst examples and seconds to the first
failure, and the median final program length. Prints a markdown table; writes every run to a JSON file.

With ``--default-run``, it measures instead how often the default ``kvfuzz run`` (its default examples,
``kvfuzz.commands.options.RUN_EXAMPLES``, of up to 50 steps over the default pool, shrinking off) catches each deep
variant (``kvfuzz.zoo.deep``; or the variants named by ``--only``) over seeds 1..N (``--seeds``, default 5 in this
mode), with the variant's own invariant and with any.

Usage: python benchmarks/detection.py [--seeds N] [--examples N] [--steps N] [--only NAME ...] [--json FILE]
       python benchmarks/detection.py --default-run [--seeds N] [--only NAME ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from kvfuzz.commands.options import RUN_EXAMPLES
from kvfuzz.engine import MachineConfig
from kvfuzz.program.execution import Target
from kvfuzz.program.random_programs import random_search
from kvfuzz.program.stats import RunStats
from kvfuzz.runner import RunSummary, run
from kvfuzz.threads import single_threaded_torch
from kvfuzz.zoo import VARIANTS, Variant


def random_only(variant: Variant, config: MachineConfig, seed: int, examples: int, steps: int) -> dict:
    stats = RunStats()
    with single_threaded_torch():
        found = random_search(Target(variant.factory(), config, stats), examples=examples, steps=steps, seed=seed)
    invariant = getattr(getattr(found, "failure", None), "invariant", None)
    return {
        "failed": found is not None,
        "expected": invariant == variant.expected,
        "examples": stats.first_failure_examples,
        "seconds": stats.first_failure_seconds,
        "length": len(found.calls) if found else None,
        "total_seconds": time.perf_counter() - stats.started,
    }


def summarised(variant: Variant, summary: RunSummary) -> dict[str, Any]:
    return {
        "failed": summary.failed,
        "expected": summary.invariant == str(variant.expected),
        "examples": summary.first_failure_examples,
        "seconds": summary.first_failure_seconds,
        "length": summary.program_length if summary.failed else None,
        "total_seconds": summary.seconds,
    }


def _stat(values: Sequence[Optional[float]], pick: Callable) -> str:
    if any(v is None for v in values):
        return "escaped"
    value = pick(values)
    return f"{value:.2f}" if isinstance(value, float) else f"{value:g}"


def cells(runs: list[dict]) -> list[str]:
    examples, seconds = [r["examples"] for r in runs], [r["seconds"] for r in runs]
    return [
        f"{sum(r['expected'] for r in runs)}/{len(runs)}",
        f"{_stat(examples, statistics.median)} / {_stat(examples, max)}",
        f"{_stat(seconds, statistics.median)} / {_stat(seconds, max)}",
        _stat([r["length"] for r in runs], statistics.median),
    ]


def default_run_rates(variants: Sequence[Variant], seeds: int, json_path: str) -> None:
    """For each variant, the default ``kvfuzz run`` over seeds 1..``seeds``: how many seeds caught it."""
    print(
        "| variant | deep | caught by the default run (its own invariant) | any invariant | examples to 1st failure, "
        "per seed |\n|---|---|---|---|---|"
    )
    records = []
    for variant in variants:
        runs = [
            summarised(variant, run(variant.factory(), MachineConfig(), examples=RUN_EXAMPLES, seed=seed, shrink=False))
            for seed in range(1, seeds + 1)
        ]
        caught, failed = sum(r["expected"] for r in runs), sum(r["failed"] for r in runs)
        per_seed = ", ".join(str(r["examples"]) if r["expected"] else ("x" if r["failed"] else "-") for r in runs)
        marked = "yes" if variant.deep else "no"
        print(f"| {variant.name} | {marked} | {caught} of {seeds} | {failed} of {seeds} | {per_seed} |", flush=True)
        records.append({"variant": variant.name, "deep": variant.deep, "caught": caught, "seeds": seeds, "runs": runs})
    deep = [record for record in records if record["deep"]]
    shallow_enough = sum(2 * record["caught"] < record["seeds"] for record in deep)
    print(f"\n{shallow_enough} of {len(deep)} deep variants caught by the default run in fewer than half the seeds")
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(records, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, help="seeds per variant (default 3; 5 with --default-run)")
    parser.add_argument("--examples", type=int, default=2000, help="budget per variant, seed and search")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--only", nargs="+", default=())
    parser.add_argument("--json", default="benchmarks/results/detection.json")
    parser.add_argument(
        "--default-run", action="store_true", help="catch rate of the default kvfuzz run on the deep variants"
    )
    args = parser.parse_args()
    if args.default_run:
        chosen = [v for v in VARIANTS if v.name in args.only] if args.only else [v for v in VARIANTS if v.deep]
        default_run_rates(chosen, args.seeds or 5, args.json)
        return
    args.seeds = args.seeds or 3

    config = MachineConfig()
    searches = ("kvfuzz", "Hypothesis only", "random only")
    header = ["variant"] + [
        f"{name}: {column}"
        for name in searches
        for column in ("caught", "examples med / worst", "seconds med / worst", "length")
    ]
    print("| " + " | ".join(header) + " |\n" + "|---" * len(header) + "|", flush=True)
    records: list[dict[str, Any]] = []
    for variant in VARIANTS:
        if args.only and variant.name not in args.only:
            continue
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in searches}
        for seed in range(args.seeds):
            runs["kvfuzz"].append(
                summarised(variant, run(variant.factory(), config, examples=args.examples, steps=args.steps, seed=seed))
            )
            runs["Hypothesis only"].append(
                summarised(
                    variant,
                    run(
                        variant.factory(),
                        config,
                        examples=args.examples,
                        steps=args.steps,
                        seed=seed,
                        random_examples=0,
                    ),
                )
            )
            runs["random only"].append(random_only(variant, config, seed, args.examples, args.steps))
        print(
            "| " + " | ".join([variant.name] + [cell for name in searches for cell in cells(runs[name])]) + " |",
            flush=True,
        )
        records.append(
            {"variant": variant.name, "bug_class": variant.bug_class, "expected": str(variant.expected), **runs}
        )

    print()
    for name in searches:
        all_runs = [r for record in records for r in record[name]]
        seconds = [r["seconds"] for r in all_runs if r["seconds"] is not None]
        lengths = [r["length"] for r in all_runs if r["length"] is not None]
        caught = sum(r["expected"] for r in all_runs)
        print(
            f"{name:16} caught by the expected invariant in {caught}/{len(all_runs)} runs; seconds to the first "
            f"failure: median {statistics.median(seconds):.2f}, worst {max(seconds):.2f}; median program length "
            f"{statistics.median(lengths):g}"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(records, indent=2))


if __name__ == "__main__":
    main()
