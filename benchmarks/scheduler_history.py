"""How fast the scheduler target finds vLLM's historical scheduler bugs (docs/scheduler-history.md).

For each bug of engine_tests/vllm_history.py, patched back into vLLM 0.33.0, and each pool size: the derandomized
search from random requests without shrinking, under the scheduling policy the bug needs (the examples, steps and
seconds until the failure is reported, Hypothesis's replay of the failing example included), then the same search
shrunk (the shrunk program, with ``--shrink``), and the same search on 0.33.0 as released (the fixes in), under each
policy, which must pass. Runs in the vLLM environment (scripts/third_party_env.sh vllm), from the repository root.

Usage: PYTHONPATH=$PWD python benchmarks/scheduler_history.py [--examples N] [--steps N] [--blocks 8 16] [--shrink]
"""

from __future__ import annotations

import argparse
from typing import Callable

import attrs
import pytest

from engine_tests.vllm_history import (
    capacity_check_ignores_evictable_hits,
    priority_victim_keeps_its_tokens,
    priority_victim_stays_scheduled,
    touch_before_the_capacity_check,
)
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.search import Outcome, search

Patch = Callable[[pytest.MonkeyPatch], None]

BUGS: dict[str, tuple[Patch, str]] = {
    "issue 11562 (touch before the capacity check)": (touch_before_the_capacity_check, "fcfs"),
    "pull 11565's review (evictable hits not counted)": (capacity_check_ignores_evictable_hits, "fcfs"),
    "issue 23347 (priority victim stays scheduled)": (priority_victim_stays_scheduled, "priority"),
    "issue 23316 (priority victim keeps its tokens)": (priority_victim_keeps_its_tokens, "priority"),
}
"""Each bug's patch, and the scheduling policy it needs."""


def patched_search(bug: Patch, setup: SchedulerSetup, args: argparse.Namespace, shrink: bool) -> Outcome:
    with pytest.MonkeyPatch.context() as patch:
        bug(patch)
        return search(setup, examples=args.examples, steps=args.steps, shrink=shrink)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500, help="the search's budget of examples")
    parser.add_argument("--steps", type=int, default=50, help="operations per example")
    parser.add_argument("--blocks", type=int, nargs="+", default=[8, 16], help="pool sizes (blocks of 4 slots)")
    parser.add_argument("--shrink", action="store_true", help="also shrink each failure and print its program")
    args = parser.parse_args()

    search(SchedulerSetup(num_blocks=args.blocks[0]), examples=1, steps=1)  # import and configure vLLM first
    for blocks in args.blocks:
        pool = SchedulerSetup(num_blocks=blocks)
        print(f"== {pool.describe()}")
        for name, (bug, policy) in BUGS.items():
            setup = attrs.evolve(pool, policy=policy)
            found = patched_search(bug, setup, args, shrink=False)
            verdict = f"found by {found.check()}" if found.failure is not None else "NOT FOUND"
            print(
                f"{name} [{policy}]: {verdict} after {found.examples} examples, {found.steps} steps, "
                f"{found.seconds:.1f} s -- {found.explanation() or '-'}"
            )
            if args.shrink and found.failure is not None:
                shrunk = patched_search(bug, setup, args, shrink=True)
                print(f"  shrunk in {shrunk.seconds:.1f} s ({shrunk.examples} examples):")
                print("\n".join(f"  {line}" for line in shrunk.program.splitlines()))
        for policy in sorted({policy for _, policy in BUGS.values()}):
            clean = search(attrs.evolve(pool, policy=policy), examples=args.examples, steps=args.steps, shrink=False)
            print(
                f"0.33.0 as released [{policy}]: "
                f"{'passed' if clean.failure is None else 'FAILED: ' + clean.explanation()} "
                f"({clean.examples} examples, {clean.steps} steps, {clean.seconds:.1f} s, {clean.preemptions} "
                f"preemptions, {clean.hit_tokens} tokens hit)"
            )


if __name__ == "__main__":
    main()
