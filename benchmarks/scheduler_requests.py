"""What drawing cache salts and stop tokens costs and changes in the scheduler target (docs/scheduler.md, "Cache
salts and stop tokens"), side by side in one process over the same derandomized examples: steps per CPU-second,
and the pressure the examples reach (preemptions, prefix-hit tokens), with neither, each, and both drawn. Runs in
the vLLM environment, from the repository root.

Usage: PYTHONPATH=$PWD python benchmarks/scheduler_requests.py [--examples N] [--blocks N]
"""

from __future__ import annotations

import argparse
import time

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.search import search

DRAWN = {
    "neither": (False, False),
    "cache salts": (True, False),
    "stop tokens": (False, True),
    "both": (True, True),
}
"""The request fields drawn, by name: the setup's (cache_salts, stop_tokens)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=30)
    parser.add_argument("--blocks", type=int, default=16)
    args = parser.parse_args()
    search(SchedulerSetup(num_blocks=args.blocks), examples=2, steps=5)  # vLLM imported before the clock starts
    for name, (salts, stops) in DRAWN.items():
        started = time.process_time()
        setup = SchedulerSetup(num_blocks=args.blocks, cache_salts=salts, stop_tokens=stops)
        outcome = search(setup, examples=args.examples, steps=30)
        rate = outcome.steps / (time.process_time() - started)
        verdict = "passed" if outcome.failure is None else f"FAILED: {outcome.failure}"
        print(
            f"{name:12}: {outcome.steps:5} steps, {rate:4.0f} steps per CPU-second, {outcome.preemptions:3} "
            f"preemptions, {outcome.hit_tokens:5} hit tokens, {verdict}",
            flush=True,
        )


if __name__ == "__main__":
    main()
