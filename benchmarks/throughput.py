"""Throughput of the full kvfuzz machine, side by side with a bare Hypothesis machine of the same rules.

Prints steps per second (a step is one executed rule) of:

* the full machine on kvfuzz's allocator at 64 blocks, every invariant checked;
* a bare Hypothesis machine with the same rules and argument strategies, bookkeeping only, no allocator and no
  checks, and the ratio of the two (target: full >= 0.5 x bare);
* the full machine at 64, 1024 and 16384 blocks (target: 16384 no more than 20% slower than 64);
* kvfuzz run's default mix (random programs for half the examples, then the machine), for reference;
* the full machine at 64 blocks under each attention kernel of invariant 2 (``--kernels``, default gather and flex),
  side by side.

Usage: python benchmarks/throughput.py [--examples N] [--steps N] [--repeats N] [--kernels K,K] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

from kvfuzz.allocator import paged_allocator
from kvfuzz.runner import run, run_settings
from kvfuzz.statemachines import MachineConfig
from kvfuzz.statemachines import strategies as kv_strategies


class BareMachine(RuleBasedStateMachine):
    """The same fourteen rules and argument strategies as kvfuzz's machine, doing bookkeeping only."""

    steps = 0

    def __init__(self) -> None:
        super().__init__()
        self.running: list[str] = []
        self.preempted: list[str] = []
        self.swapped: list[str] = []
        self.finished: list[str] = []
        self.count = 0

    def _new(self) -> str:
        self.count += 1
        return f"s{self.count}"

    def _step(self) -> None:
        BareMachine.steps += 1

    @rule(
        seq=st.runner().map(lambda m: m._new()),
        namespace=kv_strategies.namespaces(True),
        system=kv_strategies.systems(4),
        suffix=kv_strategies.suffixes(4),
    )
    def admit(self, seq, namespace, system, suffix):
        self._step()
        self.running.append(seq)

    @precondition(lambda self: self.preempted)
    @rule(seq=st.runner().flatmap(lambda m: st.sampled_from(m.preempted)))
    def readmit(self, seq):
        self._step()
        self.preempted.remove(seq)
        self.running.append(seq)

    @precondition(lambda self: self.running)
    @rule(seq=st.runner().flatmap(lambda m: st.sampled_from(m.running)), tokens=kv_strategies.appended_tokens(4))
    def grow(self, seq, tokens):
        self._step()

    @precondition(lambda self: self.running)
    @rule(parent=st.runner().flatmap(lambda m: st.sampled_from(m.running)), child=st.runner().map(lambda m: m._new()))
    def fork(self, parent, child):
        self._step()
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(seq=st.runner().flatmap(lambda m: st.sampled_from(m.running)))
    def free(self, seq):
        self._step()
        self.running.remove(seq)
        self.finished.append(seq)

    @precondition(lambda self: self.running)
    @rule(seq=st.runner().flatmap(lambda m: st.sampled_from(m.running)))
    def preempt(self, seq):
        self._step()
        self.running.remove(seq)
        self.preempted.append(seq)

    @precondition(lambda self: self.running)
    @rule(seq=st.runner().flatmap(lambda m: st.sampled_from(m.running)))
    def swap_out(self, seq):
        self._step()
        self.running.remove(seq)
        self.swapped.append(seq)

    @precondition(lambda self: self.swapped)
    @rule(seq=st.runner().flatmap(lambda m: st.sampled_from(m.swapped)))
    def swap_in(self, seq):
        self._step()
        self.swapped.remove(seq)
        self.running.append(seq)

    @precondition(lambda self: self.running)
    @rule(seq=st.runner().flatmap(lambda m: st.sampled_from(m.running)), num_tokens=st.integers(1, 6))
    def rollback(self, seq, num_tokens):
        self._step()

    @precondition(lambda self: self.finished)
    @rule(num_blocks=st.integers(1, 4))
    def evict(self, num_blocks):
        self._step()

    @precondition(lambda self: self.finished)
    @rule()
    def reset_cache(self):
        self._step()

    @rule()
    def step(self):
        self._step()

    @precondition(lambda self: self.running)
    @rule(token=st.integers(0, 3))
    def decode(self, token):
        self._step()

    @precondition(lambda self: self.running or self.finished)
    @rule(call=st.runner().flatmap(lambda m: st.sampled_from(m.running + m.finished)))
    def misuse(self, call):
        self._step()


def bare_steps_per_second(examples: int, steps: int) -> float:
    BareMachine.steps = 0
    started = time.perf_counter()
    run_state_machine_as_test(BareMachine, settings=run_settings(examples, steps))
    return BareMachine.steps / (time.perf_counter() - started)


def full_steps_per_second(
    examples: int, steps: int, num_blocks: int, random_examples: int = 0, kernel: str = "gather"
) -> float:
    """The Hypothesis machine with every check (``random_examples=0``), or kvfuzz run's default mix."""
    summary = run(
        paged_allocator,
        MachineConfig(num_blocks=num_blocks, num_host_blocks=num_blocks // 2, kernel=kernel),
        examples=examples,
        steps=steps,
        random_examples=random_examples,
    )
    if summary.failed:
        raise SystemExit(f"the correct allocator failed at {num_blocks} blocks:\n{summary.explanation}")
    return summary.steps_per_second


def median_of(repeats: int, measure: Callable[[], float]) -> float:
    return statistics.median(measure() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3, help="measurements per figure; the median is printed")
    parser.add_argument(
        "--kernels",
        default="gather,flex",
        help="attention kernels to time side by side at 64 blocks (default gather,flex)",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    figures: dict[str, float] = {}
    figures["bare_64"] = median_of(args.repeats, lambda: bare_steps_per_second(args.examples, args.steps))
    for num_blocks in (64, 1024, 16384):
        figures[f"full_{num_blocks}"] = median_of(
            args.repeats, lambda num_blocks=num_blocks: full_steps_per_second(args.examples, args.steps, num_blocks)
        )
    figures["kvfuzz_run_64"] = median_of(
        args.repeats, lambda: full_steps_per_second(args.examples, args.steps, 64, args.examples // 2)
    )
    kernels = args.kernels.split(",")
    for kernel in kernels:
        figures[f"kernel_{kernel}_64"] = median_of(
            args.repeats, lambda kernel=kernel: full_steps_per_second(args.examples, args.steps, 64, kernel=kernel)
        )
    figures["full_over_bare"] = figures["full_64"] / figures["bare_64"]
    figures["slowdown_16384_vs_64"] = 1 - figures["full_16384"] / figures["full_64"]

    print(f"{args.examples} examples x up to {args.steps} steps, median of {args.repeats}")
    print(f"  bare Hypothesis machine, same rules, no checks: {figures['bare_64']:8.0f} steps/s")
    for num_blocks in (64, 1024, 16384):
        print(f"  full machine, every invariant, {num_blocks:5} blocks:  {figures[f'full_{num_blocks}']:8.0f} steps/s")
    print(
        f"  kvfuzz run's default (half random programs, then the machine), 64 blocks: "
        f"{figures['kvfuzz_run_64']:8.0f} steps/s"
    )
    for kernel in kernels:
        print(
            f"  full machine, 64 blocks, {kernel + ' attention kernel:':<26} "
            f"{figures[f'kernel_{kernel}_64']:8.0f} steps/s"
        )
    print(f"  full / bare at 64 blocks:  {figures['full_over_bare']:.2f}  (target >= 0.50)")
    print(f"  16384 vs 64 blocks:        {100 * figures['slowdown_16384_vs_64']:+.1f}% slower  (target <= 20%)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=2)


if __name__ == "__main__":
    main()
