"""A scheduler campaign's speed on several workers against the same work on one: ``kvfuzz campaign --scheduler
vllm-v1 --workers N`` for ``--seconds`` seconds, and, for each of its N workers, a one-worker campaign of the same
length whose seed is that worker's seed stream (``worker_seed``: slot 0's is the campaign's seed), so that it draws
the same configurations in the same order, alone on the machine. Each from a fresh corpus, no known corpus.

A step's cost differs by an order of magnitude between configurations (a 64-block pool with 128-token batches
against 3 blocks of 1 token), so the totals of two campaigns that drew different configurations say nothing of
their parallelism (the two-worker campaign's second worker draws other configurations than a one-worker campaign
under the same seed). Here each worker's stream is measured twice, together and alone: the speed-up is the
N-worker campaign's steps over the mean of the streams' steps alone, and each stream's together/alone ratio is its
efficiency. Also the machine's load average before each run and the CPU seconds each campaign's processes used.
Runs in the vLLM environment, from the repository root.

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
    from kvfuzz.campaign.protocol import worker_seed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; each campaign --duration {args.seconds:g} s, --seed {args.seed}")
    corpora = Path(tempfile.mkdtemp(prefix="kvfuzz-workers-bench-"))  # kept: the failures met are real findings
    streams = [args.seed, *(worker_seed(args.seed, slot, 0) for slot in range(1, args.workers))]

    def measured(label: str, workers: int, seed: int) -> dict[str, Any]:
        load = os.getloadavg()[0]
        result, wall, cpu = campaign(workers, args.seconds, seed, corpora / label)
        each = ", ".join(str(entry["steps"]) for entry in result["per_worker"])
        print(
            f"{label}: --workers {workers} --seed {seed}: {result['steps']} steps ({result['steps_per_second']:.0f} "
            f"steps/s over {result['seconds']:.0f} s searching), per worker: {each}; {result['batches']} batches, "
            f"{len(result['failures'])} new failures; load average before {load:.2f}; {cpu:.0f} CPU s in {wall:.0f} s "
            f"wall ({result['steps'] / cpu if cpu else 0:.0f} steps per CPU-second)"
        )
        return result

    together = measured(f"together-{args.workers}", args.workers, args.seed)
    alone = [measured(f"alone-slot{slot}", 1, seed) for slot, seed in enumerate(streams)]
    print(f"the campaigns' corpora (their failures' traces): {corpora}")
    by_slot = {entry["worker"]: entry["steps"] for entry in together["per_worker"]}
    for slot, result in enumerate(alone):
        ratio = by_slot.get(slot, 0) / result["steps"] if result["steps"] else float("nan")
        print(f"worker {slot}'s stream: {by_slot.get(slot, 0)} steps together, {result['steps']} alone: {ratio:.2f}")
    mean_alone = sum(result["steps"] for result in alone) / len(alone)
    speedup = together["steps"] / mean_alone if mean_alone else float("nan")
    print(f"speed-up: {args.workers} workers ran {speedup:.2f}x the steps of one worker on the same streams")


if __name__ == "__main__":
    main()
