"""What drawing cache salts, stop tokens, EOS, min_tokens and LoRA adapters costs and changes in the scheduler target
(docs/scheduler-requests.md: cache salts and stop tokens, EOS and min_tokens, LoRA), side by side in one process over
derandomized examples: steps per CPU-second, and the pressure the examples reach (preemptions, prefix-hit tokens),
with none, each, and pairs drawn; with LoRA (``max_loras`` 1, 2 and 4, requests drawn with one of ``max_loras + 1``
adapters or none), also how often vLLM's adapter limit held a waiting request back. Runs in the vLLM environment,
from the repository root.

Usage: PYTHONPATH=$PWD python benchmarks/scheduler_requests.py [--examples N] [--blocks N]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.search import search

DRAWN: dict[str, dict[str, Any]] = {
    "neither": {},
    "cache salts": {"cache_salts": True},
    "stop tokens": {"stop_tokens": True},
    "both": {"cache_salts": True, "stop_tokens": True},
    "EOS": {"eos": True},
    "min_tokens": {"min_tokens": True},
    "EOS, min_tokens": {"eos": True, "min_tokens": True},
    "max_loras 1": {"max_loras": 1},
    "max_loras 2": {"max_loras": 2},
    "max_loras 4": {"max_loras": 4},
}
"""The request fields drawn, by name: the setup's switches turned on."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=30)
    parser.add_argument("--blocks", type=int, default=16)
    args = parser.parse_args()
    search(SchedulerSetup(num_blocks=args.blocks), examples=2, steps=5)  # vLLM imported before the clock starts
    for name, switches in DRAWN.items():
        started = time.process_time()
        setup = SchedulerSetup(num_blocks=args.blocks, **switches)
        outcome = search(setup, examples=args.examples, steps=30)
        rate = outcome.steps / (time.process_time() - started)
        verdict = "passed" if outcome.failure is None else f"FAILED: {outcome.failure}"
        held = outcome.lora_held_back
        limit = f"limit held a request back after {held:4} steps ({held / max(outcome.steps, 1):.0%}), "
        print(
            f"{name:15}: {outcome.steps:5} steps, {rate:4.0f} steps per CPU-second, {outcome.preemptions:3} "
            f"preemptions, {outcome.hit_tokens:5} hit tokens, {limit if setup.max_loras else ''}{verdict}",
            flush=True,
        )


if __name__ == "__main__":
    main()
