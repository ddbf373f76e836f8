"""Blind against coverage-guided search on a scheduler or an allocator target: two campaigns of the same duration,
seed and workers, one with ``--coverage`` (the blind search, its coverage measured), one with ``--guided``; each run
as ``kvfuzz campaign --json`` in its own process, one after the other (on a small machine, side by side they would
share its cores), each with a fresh corpus of its own (no seeds from earlier campaigns), kept after the run
(``--corpora``, a new directory under the system's temporary one unless told): the failures the campaigns met are
findings like any other, and their traces stay. The repository's corpus is both campaigns' known findings (``--known``,
repeatable; ``--no-known`` for none): a known bug met is counted, not shrunk, so neither campaign spends its time
shrinking what the corpus already holds (the side that met it first would lose search time for it). Prints the
coverage of the files under watch over time (line + branch combined, as docs/coverage.md defines it) and in all, the
failures met, and where their traces are.

Run it with the engine environment's interpreter (``scripts/third_party_env.sh vllm VLLM_ENV``, or ``sglang``)::

    VLLM_ENV/bin/python benchmarks/coverage_guided.py --scheduler vllm-v1 --duration 300
    SGLANG_ENV/bin/python benchmarks/coverage_guided.py --scheduler sglang --duration 300

An allocator's (``--allocator SPEC``, any spec ``kvfuzz campaign`` takes) prints each file of its code under test::

    python benchmarks/coverage_guided.py --allocator kvfuzz --duration 120
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvfuzz.coverage.scope import CORE_FILES

CORPUS = Path(__file__).resolve().parent.parent / "corpus"
"""The repository's corpus: the known findings both campaigns credit unless told otherwise."""

CHECKPOINTS = (0.25, 0.5, 0.75, 1.0)
"""Fractions of the duration at which the figures are printed."""


def campaign(args: argparse.Namespace, mode: str, corpus: Path) -> dict[str, Any]:
    """One campaign's ``--json`` result (``mode`` is ``--coverage`` or ``--guided``)."""
    target = ["--allocator", args.allocator] if args.allocator else ["--scheduler", args.scheduler]
    command = [sys.executable, "-m", "kvfuzz", "campaign", *target, "--seed", str(args.seed)]
    command += ["--duration", str(args.duration), "--workers", str(args.workers), "--corpus", str(corpus)]
    known = [option for directory in args.known for option in ("--known", str(directory))]
    command += [*(known or ["--no-known"]), "--json", mode]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.duration * 3 + 300, check=False)
    if not done.stdout.strip():
        raise SystemExit(f"{' '.join(command)} printed nothing (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout))


def per_file_over_time(result: dict[str, Any], duration: float) -> dict[str, list[float]]:
    """Each file's line + branch percent at each checkpoint, from the timeline's new points per file."""
    totals = {row["name"]: row["lines"] + row["branches"] for row in result["coverage"]["files"]}
    paths = {row["path"]: row["name"] for row in result["coverage"]["files"]}
    figures: dict[str, list[float]] = {name: [] for name in totals}
    reached: dict[str, int] = dict.fromkeys(totals, 0)
    timeline = result["coverage"]["timeline"]
    index = 0
    for fraction in CHECKPOINTS:
        while index < len(timeline) and (timeline[index]["seconds"] <= fraction * duration or fraction == 1.0):
            for path, new in timeline[index]["new_by_file"].items():
                if path in paths:
                    reached[paths[path]] += new
            index += 1
        for name, total in totals.items():
            figures[name].append(100.0 * reached[name] / total if total else 100.0)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheduler", choices=sorted(CORE_FILES), default="vllm-v1")
    parser.add_argument("--allocator", metavar="SPEC", help="an allocator target instead of a scheduler")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds per campaign (default 300)")
    parser.add_argument("--seed", type=int, default=20261204)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument(
        "--corpora", type=Path, help="where the two campaigns' corpora are kept (default: a new temporary directory)"
    )
    known = parser.add_mutually_exclusive_group()
    known.add_argument("--known", action="append", type=Path, metavar="DIR", help="known findings (default: corpus/)")
    known.add_argument("--no-known", action="store_true", help="no known findings: every failure met is shrunk")
    args = parser.parse_args()
    args.known = [] if args.no_known else (args.known or [CORPUS])
    corpora = args.corpora or Path(tempfile.mkdtemp(prefix="kvfuzz-coverage-bench-"))
    results = {}
    for mode in ("--coverage", "--guided"):
        results[mode] = campaign(args, mode, corpora / mode.strip("-"))
    print(
        f"{args.allocator or args.scheduler}, seed {args.seed}, {args.duration:g} s per campaign, {args.workers} "
        f"worker(s), {os.cpu_count()} CPUs; python {sys.version.split()[0]}"
    )
    header = "  ".join(f"{fraction * args.duration:>6.0f}s" for fraction in CHECKPOINTS)
    watched = CORE_FILES[args.scheduler] if not args.allocator else _reached_files(results.values())
    for name in watched:
        print(f"\n{name} (line + branch %)\n  {'search':<8}{header}")
        for mode, result in results.items():
            figures = per_file_over_time(result, args.duration).get(name)
            row = "  ".join(f"{value:6.1f}%" for value in figures) if figures else "  (not imported)"
            print(f"  {'blind' if mode == '--coverage' else 'guided':<8}{row}")
    print()
    for mode, result in results.items():
        coverage = result["coverage"]
        failures = [finding["text"] for finding in result["failures"]]
        print(
            f"{'blind' if mode == '--coverage' else 'guided':<7} {coverage['lines_reached']}/{coverage['lines']} "
            f"lines, {coverage['branches_reached']}/{coverage['branches']} branches ({coverage['percent']}%) in "
            f"{len(coverage['files'])} files; {result['examples']} examples, {result['steps']} steps, "
            f"{result['batches']} batches; new failures: {', '.join(failures) or 'none'}; known met: "
            f"{sum(known['seen'] for known in result['known'])}"
        )
    print(f"\nthe campaigns' corpora (their failures' traces): {corpora}")


def _reached_files(results: Any) -> list[str]:
    """The files of the code under test either campaign reached a point of, by name."""
    return sorted({row["name"] for result in results for row in result["coverage"]["files"] if row["lines_reached"]})


if __name__ == "__main__":
    main()
