"""The scheduler target with speculative decoding, side by side with it off (docs/scheduler-async.md, "Speculative
decoding"): for each k, the derandomized search on vLLM 0.33.0 as released, its verdict, steps, the drafts scheduled
and accepted, and steps per CPU second (process time, so that other jobs on the machine count less), each k run
alternately ``--rounds`` times so that a change of load falls on all of them. Runs in the vLLM environment
(scripts/third_party_env.sh vllm), from the repository root.

Usage: PYTHONPATH=$PWD python benchmarks/scheduler_speculative.py [--examples N] [--steps N] [--blocks N] [--k 0 1 2 4]
"""

from __future__ import annotations

import argparse
import time

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.search import search


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100, help="the search's budget of examples, per round")
    parser.add_argument("--steps", type=int, default=50, help="operations per example")
    parser.add_argument("--blocks", type=int, default=16, help="pool size (blocks of 4 slots)")
    parser.add_argument("--k", type=int, nargs="+", default=[0, 1, 2, 4], help="numbers of drafts (0: off)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds over the k values")
    args = parser.parse_args()

    setups = {k: SchedulerSetup(num_blocks=args.blocks, speculative_tokens=k) for k in args.k}
    for setup in setups.values():
        search(setup, examples=1, steps=1)  # import and configure vLLM first
    totals = {k: [0, 0.0, 0, 0, 0] for k in args.k}  # steps, CPU seconds, drafts, accepted, failures
    for _ in range(args.rounds):
        for k, setup in setups.items():
            started = time.process_time()
            outcome = search(setup, examples=args.examples, steps=args.steps, shrink=False)
            cpu = time.process_time() - started
            total = totals[k]
            total[0] += outcome.steps
            total[1] += cpu
            total[2] += outcome.drafts
            total[3] += outcome.accepted_drafts
            total[4] += outcome.failure is not None
            if outcome.failure is not None:
                print(f"k={k}: FAILED: {outcome.explanation()}")
    base = totals[args.k[0]]
    for k, (steps, cpu, drafts, accepted, failures) in totals.items():
        rate = steps / cpu if cpu else 0.0
        ratio = rate / (base[0] / base[1]) if base[1] else 0.0
        print(
            f"k={k}: {'passed' if not failures else f'{failures} FAILED'}, {steps} steps in {cpu:.1f} CPU s "
            f"({rate:.0f} steps per CPU second, {ratio:.2f} x k={args.k[0]}); {drafts} drafts, {accepted} accepted"
        )


if __name__ == "__main__":
    main()
