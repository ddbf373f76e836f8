"""A scheduler campaign's speed on one worker and on several: ``kvfuzz campaign --scheduler vllm-v1`` for
``--seconds`` seconds with ``--workers 1``, then with ``--workers N``, each from a fresh corpus under the same seed,
no known corpus: the steps of each, each worker's steps, and the ratio of the totals. Also the machine's load average
before each run and the CPU seconds the campaign's processes used (a machine shared with other work gives a worker
less than a core, and the ratio shows it). Runs in the vLLM environment, from the repository root.

Usage: PYTHONPATH=$PWD python benchmarks/scheduler_workers.py [--seconds S] [--workers N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def campaign(workers: int, seconds: float, seed: int, corpus: Path) -> tuple[dict[str, Any], float, float]:
    """The campaign's ``--json`` result, the wall seconds it took, and the CPU seconds of its processes."""
    argv = [sys.executable, "-m", "kvfuzz", "campaign", "--scheduler", "vllm-v1", "--seed", str(seed)]
    argv += ["--duration", str(seconds), "--workers", str(workers), "--corpus", str(corpus), "--no-known", "--json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):
        raise SystemExit(f"the campaign ended with status {done.returncode}:\n{done.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(done.stdout), wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; each campaign --duration {args.seconds:g} s, --seed {args.seed}")
    steps: dict[int, int] = {}
    corpora = Path(tempfile.mkdtemp(prefix="kvfuzz-workers-bench-"))  # kept: the failures met are real findings
    for workers in (1, args.workers):
        load = os.getloadavg()[0]
        result, wall, cpu = campaign(workers, args.seconds, args.seed, corpora / f"w{workers}")
        steps[workers] = result["steps"]
        each = ", ".join(str(entry["steps"]) for entry in result["per_worker"])
        print(
            f"--workers {workers}: {result['steps']} steps ({result['steps_per_second']:.0f} steps/s over "
            f"{result['seconds']:.0f} s searching), per worker: {each}; {result['batches']} batches, "
            f"{len(result['failures'])} new failures; load average before {load:.2f}; "
            f"{cpu:.0f} CPU s in {wall:.0f} s wall"
        )
    print(f"the campaigns' corpora (their failures' traces): {corpora}")
    ratio = steps[args.workers] / steps[1] if steps[1] else float("nan")
    print(f"ratio: {args.workers} workers ran {ratio:.2f}x the steps of 1")


if __name__ == "__main__":
    main()
