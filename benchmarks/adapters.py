"""Steps per second and operations exercised, per allocator, in one run each, side by side.

Runs ``kvfuzz run``'s search (random programs, then the machine) against every allocator given that can be imported
in this environment, and says which could not (a library that is not installed here). Each engine lives in its own
environment (scripts/third_party_env.sh), so run this once per environment. With ``--scheduler``, the real-scheduler
target (vLLM's v1 ``Scheduler`` in the loop, its default configuration) runs in the same process after the
allocators, the same examples and operations per example, so its steps/s stand beside theirs. Each row comes after
an untimed example that pays for imports and set-up. The scheduler's steps are ``schedule()`` calls, each scheduling
a batch of requests; an allocator's are single operations. Each row also gives steps per CPU-second of this process,
which a loaded machine changes less.

Usage: python benchmarks/adapters.py [--examples N] [--steps N] [--kernel K] [--scheduler] [ALLOCATOR ...]
"""

from __future__ import annotations

import argparse
import time

import attrs

from kvfuzz.registry import AllocatorNotFound, load_factory
from kvfuzz.runner import run
from kvfuzz.statemachines import MachineConfig

DEFAULT = [
    "kvfuzz.allocator.paged:paged_allocator",
    "kvfuzz.adapters.hf_transformers:paged_attention_cache",
    "kvfuzz.adapters.hf_transformers:paged_attention_cache_no_sharing",
    "kvfuzz.adapters.torch_paged:paged_attention",
    "kvfuzz.adapters.vllm_v1:kv_cache_manager",
    "kvfuzz.adapters.vllm_v1:kv_cache_manager_deferred_free",
    "kvfuzz.adapters.vllm_v0:block_space_manager_without_fork",
    "kvfuzz.adapters.vllm_v0:block_space_manager_no_caching",
    "kvfuzz.adapters.sglang:radix_cache",
]
SHOWN = (
    "admit",
    "grow",
    "fork",
    "free",
    "preempt",
    "readmit",
    "swap_out",
    "evict",
    "cache hits",
    "copy-on-write copies",
    "refused (out of blocks)",
    "step",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("allocators", nargs="*", default=DEFAULT)
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--kernel", default="gather")
    parser.add_argument("--host-blocks", type=int, default=0)
    parser.add_argument("--scheduler", action="store_true", help="also the vllm-v1 scheduler target (vLLM's env)")
    args = parser.parse_args()
    config = attrs.evolve(MachineConfig(num_host_blocks=args.host_blocks), kernel=args.kernel)
    for name in args.allocators:
        try:
            factory = load_factory(name)
        except AllocatorNotFound as error:
            print(f"{name}: not available here ({str(error).splitlines()[0][:100]})")
            continue
        run(factory, config, examples=1, steps=5, allocator_name=name)  # untimed: the library's imports and set-up
        cpu = time.process_time()
        summary = run(factory, config, examples=args.examples, steps=args.steps, allocator_name=name)
        cpu = time.process_time() - cpu
        counts = ", ".join(f"{op} {summary.operations[op]}" for op in SHOWN if summary.operations.get(op))
        verdict = f"FAILED ({summary.invariant})" if summary.failed else "passed"
        print(
            f"{name}: {verdict}, {summary.steps} steps in {summary.seconds:.1f} s = "
            f"{summary.steps_per_second:.0f} steps/s ({summary.steps / cpu:.0f} per CPU-second)\n    {counts}",
            flush=True,
        )
    if args.scheduler:
        scheduler_row(args.examples, args.steps)


def scheduler_row(examples: int, steps: int) -> None:
    """The vllm-v1 scheduler target's steps/s: ``kvfuzz run --scheduler vllm-v1``'s search, default configuration."""
    from kvfuzz.scheduler.config import SchedulerSetup
    from kvfuzz.scheduler.search import search

    setup = SchedulerSetup()
    search(setup, 1, 5, shrink=False)  # untimed: vLLM's imports and first scheduler, as the allocators' warm-up
    cpu = time.process_time()
    outcome = search(setup, examples, steps, shrink=False)
    cpu = time.process_time() - cpu
    verdict = "passed" if outcome.failure is None else f"FAILED ({outcome.failure})"
    print(
        f"scheduler vllm-v1 ({setup.describe()}): {verdict}, {outcome.steps} schedule() steps in "
        f"{outcome.seconds:.1f} s = {outcome.steps / outcome.seconds:.0f} steps/s ({outcome.steps / cpu:.0f} per "
        f"CPU-second)\n    preemptions {outcome.preemptions}, prompt tokens hit {outcome.hit_tokens}",
        flush=True,
    )


if __name__ == "__main__":
    main()
