"""What ``--coverage`` costs an allocator campaign: the same campaign (one worker, a fixed seed and example budget)
run with and without it, alternately, in this interpreter; prints each run's steps per second and the ratio of the
medians (coverage over bare). On CPython 3.12+ the measurer is ``sys.monitoring``, on 3.11 a tracer
(docs/coverage.md, "What it costs").

Usage: python benchmarks/allocator_coverage.py [--allocator SPEC] [--examples N] [--repeats N] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile


def campaign(allocator: str, examples: int, seed: int, coverage: bool) -> dict[str, float]:
    """One campaign's steps, seconds and steps per second (a fresh corpus, no known findings)."""
    with tempfile.TemporaryDirectory() as corpus:
        argv = [sys.executable, "-m", "kvfuzz", "campaign", "--allocator", allocator, "--workers", "1"]
        argv += ["--max-examples", str(examples), "--seed", str(seed), "--no-known", "--corpus", corpus, "--json"]
        done = subprocess.run(argv + (["--coverage"] if coverage else []), capture_output=True, text=True, check=False)
    if done.returncode not in (0, 1):
        raise SystemExit(f"the campaign failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    result = json.loads(done.stdout)
    return {"steps": result["steps"], "seconds": result["seconds"], "rate": result["steps_per_second"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocator", default="kvfuzz")
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rates: dict[bool, list[float]] = {False: [], True: []}
    print(f"Python {platform.python_version()}: {args.allocator}, {args.examples} examples, seed {args.seed}")
    for repeat in range(args.repeats):
        for coverage in (False, True):
            run = campaign(args.allocator, args.examples, args.seed, coverage)
            rates[coverage].append(run["rate"])
            label = "--coverage" if coverage else "bare      "
            print(f"  {repeat + 1} {label} {run['steps']:>7} steps in {run['seconds']:6.2f} s: {run['rate']:8.1f} /s")
    bare, measured = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"median steps/s: bare {bare:.1f}, --coverage {measured:.1f}; ratio {measured / bare:.2f}")


if __name__ == "__main__":
    main()
