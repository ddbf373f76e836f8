"""Time to first failure of ``kvfuzz campaign`` on the zoo's deep variants, this checkout beside a baseline checkout.

For each deep variant (``Variant.deep``; or the variants named by ``--variants``) and each seed 1..N, a campaign
``kvfuzz campaign --allocator zoo:NAME --duration S --stop-after 1 --seed SEED --json`` runs in a child interpreter
of each checkout (``PYTHONPATH`` set to it, a fresh temporary directory as its working directory and corpus, so no
known corpus counts), interleaved variant by variant and seed by seed: the baseline's campaign, then this checkout's,
so that the load of a shared machine falls on both alike. ``--stop-after 1`` ends each campaign at its first new
finding, and ``--shrink-time`` (default 1 s) keeps the shrink that follows short: it is no part of the figure.

Figures per campaign:

* seconds to the first failure: the finding's ``first_seconds`` from the campaign's JSON (wall time on the
  campaign's own clock, from its start to the worker reporting the failure; interpreter start-up and the shrink
  excluded), or nothing when the campaign met none within its duration;
* CPU seconds of the whole campaign process and its workers (``RUSAGE_CHILDREN`` around the child): start-up,
  search until the first failure, the short shrink and the exit. It is the load-independent figure, but diluted by
  the start-up both checkouts pay alike.

Prints a markdown table: per variant, each checkout's median seconds to the first failure over the seeds (a
campaign that found nothing counts as later than any that did; a median among those reads "not found"), the
examples to it, the campaign CPU seconds, and the ratio baseline / current; then the median over the variants and
how many of the campaigns found a failure. Any failure found against a zoo variant is real (the correct allocator
runs clean), so the first finding counts whatever its invariant; the table says what it was when it is not the
invariant the variant names.

The two sides may also be one checkout run two ways: ``--baseline-options`` and ``--current-options`` add
``kvfuzz campaign`` options to each side's campaigns (without ``--baseline``, both sides are this checkout), so
that blind search and coverage-guided search compare side by side::

    python benchmarks/first_failure.py --current-options=--guided

Usage: python benchmarks/first_failure.py [--baseline CHECKOUT] [--baseline-options OPTIONS]
                                          [--current-options OPTIONS] [--variants NAME ...] [--seeds N]
                                          [--duration S] [--workers N] [--shrink-time S] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import attrs

from kvfuzz.zoo import VARIANTS, Variant

CURRENT = Path(__file__).resolve().parent.parent


@attrs.frozen
class Attempt:
    """One campaign of one checkout on one variant and seed. ``seconds`` is None when it met no failure."""

    tree: str  # "baseline" or "current"
    variant: str
    seed: int
    seconds: Optional[float]  # wall seconds into the campaign when its first failure was met
    examples: Optional[int]  # examples the campaign had run by then
    failure: Optional[str]  # what the first failure was: "invariant 9 (cache soundness)", "crash (KeyError)"
    cpu_seconds: float  # CPU time of the campaign process and its workers, start to exit
    wall_seconds: float  # wall time of the child process, start to exit


def child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_campaign(
    tree: str,
    checkout: Path,
    variant: Variant,
    seed: int,
    duration: float,
    workers: int,
    shrink_time: float,
    options: Sequence[str] = (),
) -> Attempt:
    with tempfile.TemporaryDirectory(prefix="kvfuzz-ttff-") as scratch:
        command = [
            sys.executable,
            "-m",
            "kvfuzz.cli",
            "campaign",
            "--allocator",
            f"zoo:{variant.name}",
            "--duration",
            str(duration),
            "--stop-after",
            "1",
            "--seed",
            str(seed),
            "--workers",
            str(workers),
            "--shrink-time",
            str(shrink_time),
            "--corpus",
            str(Path(scratch) / "corpus"),
            "--json",
            *options,
        ]
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        cpu_before = child_cpu()
        wall_before = time.monotonic()
        done = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True, timeout=duration + 600)
        wall = time.monotonic() - wall_before
        cpu = child_cpu() - cpu_before
    if done.returncode not in (0, 1):
        raise SystemExit(f"{tree} campaign on {variant.name} seed {seed} exited {done.returncode}:\n{done.stderr}")
    result = json.loads(done.stdout)
    failures = sorted(result["failures"], key=lambda finding: finding["first_seconds"])
    first = failures[0] if failures else None
    return Attempt(
        tree,
        variant.name,
        seed,
        None if first is None else first["first_seconds"],
        None if first is None else first["first_examples"],
        None if first is None else first["signature"]["failure"],
        cpu,
        wall,
    )


def median_or_none(values: Sequence[Optional[float]]) -> Optional[float]:
    """The median, a missing value counting as later than any present one; None when the median is missing."""
    median = statistics.median(math.inf if value is None else value for value in values)
    return None if math.isinf(median) else median


def seconds_text(value: Optional[float], duration: float) -> str:
    return f"not found in {duration:g} s" if value is None else f"{value:.1f} s"


def ratio_text(before: Optional[float], after: Optional[float]) -> str:
    if before is None or after is None:
        return "-"
    return f"{before / after:.2f}" if after else "-"


def table(attempts: Sequence[Attempt], variants: Sequence[Variant], duration: float) -> list[str]:
    lines = [
        "| variant | baseline: s to 1st failure (median) | per seed | examples | CPU s | "
        "current: s to 1st failure (median) | per seed | examples | CPU s | ratio baseline / current |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    medians: dict[str, list[Optional[float]]] = {"baseline": [], "current": []}
    for variant in variants:
        cells = [variant.name]
        per_tree: dict[str, Optional[float]] = {}
        for tree in ("baseline", "current"):
            mine = [attempt for attempt in attempts if attempt.variant == variant.name and attempt.tree == tree]
            median = median_or_none([attempt.seconds for attempt in mine])
            per_tree[tree] = median
            medians[tree].append(median)
            seeds = ", ".join(
                "-" if attempt.seconds is None else f"{attempt.seconds:.1f}" + _unexpected(attempt, variant)
                for attempt in mine
            )
            examples = ", ".join("-" if attempt.examples is None else str(attempt.examples) for attempt in mine)
            cpu = ", ".join(f"{attempt.cpu_seconds:.0f}" for attempt in mine)
            cells += [seconds_text(median, duration), seeds, examples, cpu]
        cells.append(ratio_text(per_tree["baseline"], per_tree["current"]))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for tree in ("baseline", "current"):
        mine = [attempt for attempt in attempts if attempt.tree == tree]
        found = sum(attempt.seconds is not None for attempt in mine)
        overall = median_or_none(medians[tree])
        lines.append(
            f"{tree}: median over the variants {seconds_text(overall, duration)}; "
            f"{found} of {len(mine)} campaigns found a failure; campaign CPU {sum(a.cpu_seconds for a in mine):.0f} s"
        )
    before, after = median_or_none(medians["baseline"]), median_or_none(medians["current"])
    lines.append(f"ratio of the medians over the variants, baseline / current: {ratio_text(before, after)}")
    return lines


def _unexpected(attempt: Attempt, variant: Variant) -> str:
    """Nothing when the first failure broke the invariant the variant names (or there was none), else what it was."""
    number, _ = variant.expected.value
    expected = attempt.failure is None or attempt.failure.startswith(f"invariant {number} ")
    return "" if expected else f" ({attempt.failure})"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="the checkout to compare with (the 'before'; default: this one)")
    parser.add_argument("--baseline-options", default="", help="kvfuzz campaign options of the baseline's campaigns")
    parser.add_argument("--current-options", default="", help="kvfuzz campaign options of this checkout's campaigns")
    parser.add_argument("--variants", nargs="+", metavar="NAME", help="these zoo variants (default: the deep ones)")
    parser.add_argument("--seeds", type=int, default=3, help="campaign seeds 1..N (default 3)")
    parser.add_argument("--duration", type=float, default=60.0, help="each campaign's budget in seconds (default 60)")
    parser.add_argument("--workers", type=int, default=2, help="each campaign's workers (default 2)")
    parser.add_argument("--shrink-time", type=float, default=1.0, help="each campaign's shrink bound (default 1)")
    parser.add_argument("--json", type=Path, help="write every campaign's figures here")
    args = parser.parse_args(argv)
    by_name = {variant.name: variant for variant in VARIANTS}
    unknown = [name for name in args.variants or () if name not in by_name]
    if unknown:
        parser.exit(2, f"first_failure.py: no zoo variant named {', '.join(unknown)}\n")
    options = {"baseline": shlex.split(args.baseline_options), "current": shlex.split(args.current_options)}
    if args.baseline is None and options["baseline"] == options["current"]:
        parser.exit(2, "first_failure.py: --baseline, or options that differ, say what to compare\n")
    args.baseline = args.baseline or CURRENT
    if not (args.baseline / "kvfuzz" / "cli.py").exists() and not (args.baseline / "kvfuzz" / "cli").is_dir():
        parser.exit(2, f"first_failure.py: {args.baseline} is not a kvfuzz checkout\n")
    if args.seeds < 1 or args.duration <= 0 or args.workers < 1:
        parser.exit(2, "first_failure.py: --seeds and --workers must be at least 1 and --duration positive\n")
    variants = [by_name[name] for name in args.variants] if args.variants else [v for v in VARIANTS if v.deep]
    trees = {"baseline": args.baseline.resolve(), "current": CURRENT}
    print(f"# load average at start: {' '.join(f'{load:.2f}' for load in os.getloadavg())}", flush=True)
    attempts: list[Attempt] = []
    for variant in variants:
        for seed in range(1, args.seeds + 1):
            for tree, checkout in trees.items():
                attempt = run_campaign(
                    tree, checkout, variant, seed, args.duration, args.workers, args.shrink_time, options[tree]
                )
                attempts.append(attempt)
                print(
                    f"# {variant.name} seed {seed} {tree}: first failure "
                    f"{seconds_text(attempt.seconds, args.duration)}, {attempt.examples} examples, "
                    f"{attempt.failure}; campaign CPU {attempt.cpu_seconds:.1f} s, wall {attempt.wall_seconds:.1f} s",
                    flush=True,
                )
    print(f"# load average at end: {' '.join(f'{load:.2f}' for load in os.getloadavg())}")
    print(
        f"\n{len(variants)} variants, seeds 1-{args.seeds}, {args.duration:g} s campaigns with {args.workers} workers "
        f"(--stop-after 1); baseline {trees['baseline']} {args.baseline_options}, current {trees['current']} "
        f"{args.current_options}\n"
    )
    print("\n".join(table(attempts, variants, args.duration)))
    if args.json:
        args.json.write_text(json.dumps([attrs.asdict(attempt) for attempt in attempts], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
