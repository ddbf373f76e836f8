"""What vLLM's OffloadingConnector costs and reaches in the scheduler target (docs/scheduler-connectors.md),
side by side in one process over the same derandomized examples: steps per CPU-second without the connector, with
it, with late transfers and with late transfers and failed loads; and the stores, loads, failed loads, late reports
and flushes each run made. Runs in the vLLM environment, from the repository root.

Usage: PYTHONPATH=$PWD python benchmarks/scheduler_offloading.py [--examples N] [--blocks N] [--block-size N]
"""

from __future__ import annotations

import argparse
import time

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.search import search

CONNECTORS = {
    "no connector": ("none", 0, False),
    "offloading": ("offloading", 0, False),
    "late by <= 2": ("offloading", 2, False),
    "late, failing": ("offloading", 2, True),
}
"""The connector runs, by name: the setup's (kv_connector, transfer_delay, load_failures)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=30)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=2)
    args = parser.parse_args()
    search(SchedulerSetup(num_blocks=args.blocks), examples=2, steps=5)  # vLLM imported before the clock starts
    for name, (connector, delay, failures) in CONNECTORS.items():
        setup = SchedulerSetup(
            num_blocks=args.blocks,
            block_size=args.block_size,
            kv_connector=connector,
            transfer_delay=delay,
            load_failures=failures,
        )
        started = time.process_time()
        outcome = search(setup, examples=args.examples, steps=30)
        rate = outcome.steps / (time.process_time() - started)
        verdict = "passed" if outcome.failure is None else f"FAILED: {outcome.failure}"
        t = outcome.transfers
        print(
            f"{name:13}: {outcome.steps:5} steps, {rate:4.0f} steps per CPU-second, {outcome.hit_tokens:5} hit "
            f"tokens; {t.stores:4} stores, {t.loads:3} loads, {t.failed_loads:3} failed, {t.late:4} late, "
            f"{t.flushed:3} flushed; {verdict}",
            flush=True,
        )


if __name__ == "__main__":
    main()
