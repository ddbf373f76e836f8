"""What ``kvfuzz campaign`` achieves on this machine, measured side by side in one run:

1. scaling: examples/s and steps/s of a campaign against kvfuzz's correct allocator with 1 worker, then 2 workers,
   for the same duration (the ratio is the figure; the correct allocator must also run clean: any failure is
   printed);
2. two bugs: a campaign against ``kvfuzz.zoo.combined:shallow_and_deep`` (NoCopyOnWrite, shallow, and
   SwapInWrongHostBlock, deeper): which distinct failures it reports, and for each saved trace which of the two
   variants it reproduces against;
3. the zoo: for every zoo variant and seed, a campaign with 2 workers that ends at its first distinct failure (or
   its duration): whether it caught the variant, whether that failure is the variant's expected invariant, seconds
   to it, and its shrunk length. Median and worst over the seeds. (Every failure a campaign reports against a zoo
   variant is real: the correct allocator runs clean.)

Usage: python benchmarks/campaign.py [--scaling-seconds S] [--two-bugs-seconds S] [--seconds S] [--seeds N]
                                     [--workers N] [--only NAME ...] [--skip-zoo | --zoo-only] [--json FILE]
                                     [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any, Optional

from kvfuzz.campaign.report import CampaignResult
from kvfuzz.campaign.supervisor import CampaignOptions, run_campaign
from kvfuzz.campaign.swarm import probe_limits
from kvfuzz.engine.config import MachineConfig
from kvfuzz.registry import DEFAULT_ALLOCATOR, load_factory
from kvfuzz.saved.corpus import replay_trace
from kvfuzz.saved.trace import load
from kvfuzz.zoo import VARIANTS


def campaign(
    spec: str, seconds: float, workers: int, seed: int, corpus: Path, stop_after: Optional[int] = None
) -> CampaignResult:
    limits = probe_limits(spec, load_factory(spec), MachineConfig())
    options = CampaignOptions((spec,), (limits,), workers, corpus, duration=seconds, stop_after=stop_after, seed=seed)
    return run_campaign(options)


def scaling(seconds: float) -> dict[str, Any]:
    rows: dict[int, dict[str, Any]] = {}
    for workers in (1, 2):
        with tempfile.TemporaryDirectory() as corpus:
            result = campaign(DEFAULT_ALLOCATOR, seconds, workers, 0, Path(corpus))
        rows[workers] = {
            "examples_per_second": result.examples / result.seconds,
            "steps_per_second": result.steps_per_second,
            "examples": result.examples,
            "seconds": result.seconds,
            "failures": [finding.text for finding in result.findings],
        }
    ratio = rows[2]["examples_per_second"] / rows[1]["examples_per_second"]
    print(f"## scaling: the correct allocator, {seconds:g} s per campaign\n")
    print("| workers | examples | examples/s | steps/s | failures |\n|---|---|---|---|---|")
    for workers, row in rows.items():
        print(
            f"| {workers} | {row['examples']} | {row['examples_per_second']:.1f} | {row['steps_per_second']:.0f} | "
            f"{len(row['failures'])} {row['failures'] or ''} |"
        )
    print(f"\n2 workers / 1 worker: {ratio:.2f}x examples/s\n", flush=True)
    return {"rows": rows, "ratio": ratio}


def two_bugs(seconds: float, workers: int) -> dict[str, Any]:
    spec = "kvfuzz.zoo.combined:shallow_and_deep"
    with tempfile.TemporaryDirectory() as corpus:
        result = campaign(spec, seconds, workers, 0, Path(corpus))
        rows: list[dict[str, Any]] = []
        for finding in result.new:
            against: list[str] = []
            if finding.trace is not None:
                trace = load(Path(finding.trace))
                against = [
                    name
                    for name in ("NoCopyOnWrite", "SwapInWrongHostBlock")
                    if replay_trace(trace, f"zoo:{name}").reproduced
                ]
            rows.append(
                {
                    "signature": finding.text,
                    "first_seconds": finding.first_seconds,
                    "shrunk_length": finding.shrunk_length,
                    "reproduces_against": against,
                }
            )
    print(f"## two bugs in one allocator ({spec}), {seconds:g} s, {workers} workers\n")
    print("| signature | first found (s) | shrunk length | reproduces against |\n|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['signature']} | {row['first_seconds']:.1f} | {row['shrunk_length']} | "
            f"{', '.join(row['reproduces_against']) or '-'} |"
        )
    found = {name for row in rows for name in row["reproduces_against"]}
    print(f"\nboth bugs reported: {found == {'NoCopyOnWrite', 'SwapInWrongHostBlock'}}\n", flush=True)
    return {"rows": rows, "both": found == {"NoCopyOnWrite", "SwapInWrongHostBlock"}}


def zoo(seconds: float, seeds: int, workers: int, only: list[str], keep: Optional[Path]) -> list[dict[str, Any]]:
    print(f"## the zoo: a {seconds:g} s campaign with {workers} workers per variant and seed ({seeds} seeds)\n")
    print("| variant | expected | caught | as expected | first failure s (median / worst) | shrunk (median / worst) |")
    print("|---|---|---|---|---|---|", flush=True)
    records: list[dict[str, Any]] = []
    for variant in VARIANTS:
        if only and variant.name not in only:
            continue
        runs: list[dict[str, Any]] = []
        for seed in range(seeds):
            if keep is not None:
                result = campaign(f"zoo:{variant.name}", seconds, workers, seed, keep / f"{variant.name}-{seed}", 1)
            else:
                with tempfile.TemporaryDirectory() as corpus:
                    result = campaign(f"zoo:{variant.name}", seconds, workers, seed, Path(corpus), stop_after=1)
            first = min(result.new, key=lambda finding: finding.first_seconds) if result.new else None
            runs.append(
                {
                    "caught": first is not None,
                    "as_expected": first is not None and first.signature["failure"] == str(variant.expected),
                    "seconds": first.first_seconds if first else None,
                    "shrunk_length": first.shrunk_length if first else None,
                    "shrink_note": first.note if first else None,
                    "distinct": len(result.new),
                }
            )
        caught = [run for run in runs if run["caught"]]
        times = [run["seconds"] for run in caught]
        lengths = [run["shrunk_length"] for run in caught if run["shrunk_length"] is not None]
        expected = sum(run["as_expected"] for run in runs)
        print(
            f"| {variant.name} | {variant.expected} | {len(caught)}/{len(runs)} | {expected}/{len(runs)} | "
            f"{_pair(times, '.1f')} | {_pair(lengths, 'g')} |",
            flush=True,
        )
        records.append({"variant": variant.name, "expected": str(variant.expected), "runs": runs})
    every = [run for record in records for run in record["runs"]]
    lengths = [run["shrunk_length"] for run in every if run["shrunk_length"] is not None]
    times = [run["seconds"] for run in every if run["seconds"] is not None]
    if every:
        print(
            f"\ncaught {sum(run['caught'] for run in every)}/{len(every)} runs; time to first failure median "
            f"{_median(times, '.1f')} s; shrunk length median {_median(lengths, 'g')}, worst "
            f"{max(lengths) if lengths else '-'}"
        )
    return records


def _median(values: list[Any], form: str) -> str:
    return format(statistics.median(values), form) if values else "-"


def _pair(values: list[Any], form: str) -> str:
    return f"{_median(values, form)} / {format(max(values), form) if values else '-'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scaling-seconds", type=float, default=30.0)
    parser.add_argument("--two-bugs-seconds", type=float, default=60.0)
    parser.add_argument("--seconds", type=float, default=60.0, help="each zoo campaign's duration")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--only", nargs="+", default=[])
    parser.add_argument("--skip-zoo", action="store_true")
    parser.add_argument("--zoo-only", action="store_true", help="only the zoo's table")
    parser.add_argument("--json", default="benchmarks/results/campaign.json")
    parser.add_argument("--keep", type=Path, help="keep each zoo campaign's traces in KEEP/VARIANT-SEED")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    if not args.zoo_only:
        results["scaling"] = scaling(args.scaling_seconds)
        results["two_bugs"] = two_bugs(args.two_bugs_seconds, args.workers)
    if not args.skip_zoo:
        results["zoo"] = zoo(args.seconds, args.seeds, args.workers, args.only, args.keep)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
