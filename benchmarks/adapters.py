"""Steps per second and operations exercised, per allocator, in one run each, side by side.

Runs ``kvfuzz run``'s search (random programs, then the machine) against every allocator given that can be imported
in this environment, and says which could not (a library that is not installed here). Each engine lives in its own
environment (scripts/third_party_env.sh), so run this once per environment.

Usage: python benchmarks/adapters.py [--examples N] [--steps N] [--kernel K] [ALLOCATOR ...]
"""

from __future__ import annotations

import argparse

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
    args = parser.parse_args()
    config = attrs.evolve(MachineConfig(num_host_blocks=args.host_blocks), kernel=args.kernel)
    for name in args.allocators:
        try:
            factory = load_factory(name)
        except AllocatorNotFound as error:
            print(f"{name}: not available here ({str(error).splitlines()[0][:100]})")
            continue
        summary = run(factory, config, examples=args.examples, steps=args.steps, allocator_name=name)
        counts = ", ".join(f"{op} {summary.operations[op]}" for op in SHOWN if summary.operations.get(op))
        verdict = f"FAILED ({summary.invariant})" if summary.failed else "passed"
        print(
            f"{name}: {verdict}, {summary.steps} steps in {summary.seconds:.1f} s = "
            f"{summary.steps_per_second:.0f} steps/s\n    {counts}",
            flush=True,
        )


if __name__ == "__main__":
    main()
