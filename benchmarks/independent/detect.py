"""How ``kvfuzz run`` fares on the independent variants: caught or missed, by what, and how fast.

For every bug of :data:`benchmarks.independent.BUGS` (or those named by ``--only``) and every seed 1..N, runs
``kvfuzz run --allocator benchmarks.independent.variants:NAME --seed S --json --no-shrink`` (default examples,
steps and pool) in a child process, as a user would, and prints one markdown row per bug: how many seeds caught it,
the invariants reported, and the median and worst examples and seconds to the first failure. A run that passes is a
miss; a run killed by the timeout is reported as such. ``--base`` runs the correct base instead, which must pass.

Usage: python -m benchmarks.independent.detect [--seeds N] [--only NAME ...] [--timeout SECONDS] [--base]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from . import BUGS

ROOT = Path(__file__).resolve().parents[2]
BASE = "benchmarks.independent.base:factory"


def run_once(spec: str, seed: int, timeout: float) -> dict[str, Any]:
    """One ``kvfuzz run`` of ``spec`` under ``seed``: its JSON object, or ``{"timeout": True}``."""
    command = [sys.executable, "-m", "kvfuzz", "run", "--allocator", spec, "--seed", str(seed), "--json", "--no-shrink"]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"timeout": True}
    if done.returncode not in (0, 1):
        return {"error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def row(name: str, results: Sequence[dict[str, Any]]) -> str:
    caught = [r for r in results if r.get("failed")]
    invariants = sorted({str(r["invariant"]) for r in caught})
    examples = [r["first_failure_examples"] for r in caught if r.get("first_failure_examples") is not None]
    seconds = [r["first_failure_seconds"] for r in caught if r.get("first_failure_seconds") is not None]
    other = [("timeout" if r.get("timeout") else "error") for r in results if r.get("timeout") or r.get("error")]

    def stats(values: Sequence[float], digits: int) -> str:
        return f"{statistics.median(values):.{digits}f} / {max(values):.{digits}f}" if values else "-"

    note = f" ({', '.join(other)})" if other else ""
    return (
        f"| {name} | {len(caught)}/{len(results)}{note} | {'; '.join(invariants) or 'none: passed (a miss)'} | "
        f"{stats(examples, 0)} | {stats(seconds, 2)} |"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N (default 3)")
    parser.add_argument("--only", nargs="*", default=None, help="bug names to run")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per kvfuzz run (default 300)")
    parser.add_argument("--base", action="store_true", help="run the correct base allocator instead")
    args = parser.parse_args(argv)
    known = {bug.name for bug in BUGS}
    unknown = sorted(set(args.only or ()) - known)
    if args.seeds < 1 or unknown:
        problem = f"unknown bug names {unknown}" if unknown else "--seeds must be at least 1"
        print(f"detect: {problem}", file=sys.stderr)
        return 2
    targets = (
        [("base", BASE)] if args.base else [(b.name, b.spec) for b in BUGS if not args.only or b.name in args.only]
    )
    print("| variant | caught | invariants | examples to first failure (median / worst) | seconds (median / worst) |")
    print("|---|---|---|---|---|")
    for name, spec in targets:
        results = [run_once(spec, seed, args.timeout) for seed in range(1, args.seeds + 1)]
        print(row(name, results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
