"""Steps per CPU-second of the scheduler target with each write path and with attention off and on
(docs/scheduler.md, "Write paths and attention"), measured side by side in one process over the same derandomized
examples: kvfuzz's own slot mapping, vLLM's worker-side block tables with its Triton slot mapping kernel (Triton's
interpreter), and the gather attention check. Runs in the vLLM environment, from the repository root.

Usage: PYTHONPATH=$PWD python benchmarks/scheduler_write_paths.py [--examples N] [--blocks N]
"""

from __future__ import annotations

import argparse
import time

from kvfuzz.scheduler.write_paths import WRITE_PATHS, prepare_write_path

prepare_write_path("vllm")  # Triton's interpreter, before vLLM is imported

from kvfuzz.scheduler.attention import ATTENTIONS  # noqa: E402
from kvfuzz.scheduler.config import SchedulerSetup  # noqa: E402
from kvfuzz.scheduler.search import search  # noqa: E402
from kvfuzz.scheduler.session import WorkerFactory  # noqa: E402
from kvfuzz.scheduler.worker import Worker  # noqa: E402


def worker_for(write_path: str, attention: str) -> WorkerFactory:
    """The worker of each example: the write path and attention check named."""
    factory, check = WRITE_PATHS[write_path], ATTENTIONS[attention]
    return lambda setup: Worker(setup, factory, check(setup.block_size))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=30)
    parser.add_argument("--blocks", type=int, default=16)
    args = parser.parse_args()
    setup = SchedulerSetup(num_blocks=args.blocks)
    search(setup, examples=2, steps=5)  # vLLM imported and configured before the clock starts
    baseline = None
    for write_path in ("kvfuzz", "vllm"):
        for attention in ("off", "gather"):
            started = time.process_time()
            outcome = search(
                setup,
                examples=args.examples,
                steps=50,
                shrink=False,
                worker=worker_for(write_path, attention),
            )
            rate = outcome.steps / (time.process_time() - started)
            baseline = baseline or rate
            verdict = "passed" if outcome.failure is None else f"FAILED: {outcome.failure}"
            print(
                f"write path {write_path:6} attention {attention:6}: {outcome.steps} steps, {rate:6.0f} steps per "
                f"CPU-second ({baseline / rate:4.1f}x the CPU of kvfuzz/off), {verdict}",
                flush=True,
            )


if __name__ == "__main__":
    main()
