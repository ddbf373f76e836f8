"""What drawing LoRA adapters costs and changes in the scheduler target (docs/scheduler.md, "LoRA"), side by side in
one process over derandomized examples: steps per CPU-second, the pressure the examples reach (preemptions,
prefix-hit tokens), and how often vLLM's adapter limit held a waiting request back, without LoRA and with
``max_loras`` 1, 2 and 4 (requests drawn with one of ``max_loras + 1`` adapters, or none). Runs in the vLLM
environment, from the repository root.

Usage: PYTHONPATH=$PWD python benchmarks/scheduler_lora.py [--examples N] [--blocks N]
"""

from __future__ import annotations

import argparse
import time

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.search import search

MAX_LORAS = (0, 1, 2, 4)
"""The ``max_loras`` of each row (0: no LoRA, the default)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=30)
    parser.add_argument("--blocks", type=int, default=16)
    args = parser.parse_args()
    search(SchedulerSetup(num_blocks=args.blocks), examples=2, steps=5)  # vLLM imported before the clock starts
    for max_loras in MAX_LORAS:
        started = time.process_time()
        setup = SchedulerSetup(num_blocks=args.blocks, max_loras=max_loras)
        outcome = search(setup, examples=args.examples, steps=30)
        rate = outcome.steps / (time.process_time() - started)
        verdict = "passed" if outcome.failure is None else f"FAILED: {outcome.failure}"
        name = f"max_loras {max_loras}" if max_loras else "no LoRA"
        print(
            f"{name:11}: {outcome.steps:5} steps, {rate:4.0f} steps per CPU-second, {outcome.preemptions:3} "
            f"preemptions, {outcome.hit_tokens:5} hit tokens, limit held a request back after "
            f"{outcome.lora_held_back:4} steps ({outcome.lora_held_back / max(outcome.steps, 1):.0%}), {verdict}",
            flush=True,
        )


if __name__ == "__main__":
    main()
