"""Throughput of the full kvfuzz machine, side by side with a bare Hypothesis machine of the same rules.

Prints steps per second (a step is one executed rule) of:

* the full machine on kvfuzz's allocator at 64 blocks, every invariant checked;
* a bare Hypothesis machine built from the same operation table (rules, enablement, argument strategies),
  bookkeeping only, no allocator and no checks, and the ratio of the two (target: full >= 0.75 x bare);
* the full machine at 64, 1024 and 16384 blocks (target: 16384 no more than 20% slower than 64);
* kvfuzz run's default mix (random programs for half the examples, then the machine), for reference;
* a campaign worker: a one-worker ``kvfuzz campaign`` against kvfuzz's allocator for ``--campaign-seconds``
  (its own process, swarmed pools and operation subsets, random batches between Hypothesis rounds, every check), and
  its ratio to the bare machine (target: worker >= 0.75 x bare);
* the full machine at 64 blocks under each attention kernel of invariant 2 (``--kernels``, default gather and flex),
  side by side.

Usage: python benchmarks/throughput.py [--examples N] [--steps N] [--repeats N] [--kernels K,K]
                                       [--campaign-seconds S] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, cast

from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test
from hypothesis.strategies import SearchStrategy

from kvfuzz.allocator import paged_allocator
from kvfuzz.allocator.types import Capabilities, PoolSpec, SeqId
from kvfuzz.campaign.supervisor import CampaignOptions, run_campaign
from kvfuzz.campaign.swarm import probe_limits
from kvfuzz.engine import MachineConfig, Status
from kvfuzz.engine.expected import ProgramState
from kvfuzz.engine.operation import Operation
from kvfuzz.program.operations import OPERATIONS
from kvfuzz.registry import DEFAULT_ALLOCATOR, load_factory
from kvfuzz.runner import run, run_settings


class BareState:
    """The queries the operation table makes (``kvfuzz.engine.expected.ProgramState``), answered by bookkeeping
    alone: no allocator, no K/V, no checks. Lengths and statuses follow the real engine's, so the table enables the
    same operations with the same arguments as on kvfuzz's allocator. The machine holds it as a ``ProgramState``,
    so a query the protocol gains and this class lacks fails CI's type check (mypy kvfuzz/ benchmarks/)."""

    def __init__(self, caps: Capabilities, block_size: int, num_host_blocks: int) -> None:
        self.caps = caps
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.status: dict[SeqId, Status] = {}  # live sequences
        self.lengths: dict[SeqId, int] = {}  # tokens of each live sequence
        self.computed: set[SeqId] = set()  # running sequences whose every token a step has written
        self.finished: list[SeqId] = []
        self.count = 0

    def new_id(self) -> SeqId:
        self.count += 1
        return f"s{self.count - 1}"

    def is_fresh(self, seq: SeqId) -> bool:
        return seq not in self.status and seq not in self.finished

    def ids(self, status: Status) -> list[SeqId]:
        return [seq for seq, current in self.status.items() if current is status]

    def live_ids(self) -> list[SeqId]:
        return [seq for seq, current in self.status.items() if current is not Status.PREEMPTED]

    def computed_ids(self) -> list[SeqId]:
        return [seq for seq in self.ids(Status.RUNNING) if seq in self.computed]

    def preemptible_ids(self) -> list[SeqId]:
        return self.ids(Status.RUNNING) if self.caps.preempt_scheduled else self.computed_ids()

    def freeable_ids(self) -> list[SeqId]:
        if self.caps.free_scheduled:
            return self.live_ids()
        return [seq for seq in self.live_ids() if self.status[seq] is not Status.RUNNING or seq in self.computed]

    def rollbackable_ids(self) -> list[SeqId]:
        return [seq for seq in self.ids(Status.RUNNING) if self.rollback_limit(seq) >= 1]

    def rollback_limit(self, seq: SeqId) -> int:
        return self.lengths[seq] - 1

    def length(self, seq: SeqId) -> int:
        return self.lengths[seq]

    def released_blocks(self) -> list[int]:
        """No blocks are modelled here, so targeted eviction is never drawn (the real machine draws it when a
        sequence has released blocks)."""
        return []

    def landable_ids(self) -> list[SeqId]:
        """No loads are modelled here (kvfuzz's allocator has no host tier), so none is ever reported landed."""
        return []

    # -- what each operation does to the bookkeeping -------------------------------------------------------------

    def admit(self, seq: SeqId, namespace: tuple, system: tuple, suffix: list) -> None:
        self.status[seq], self.lengths[seq] = Status.RUNNING, len(system) + len(suffix)

    def step(self) -> None:
        self.computed.update(self.ids(Status.RUNNING))

    def readmit(self, seq: SeqId) -> None:
        self.status[seq] = Status.RUNNING

    def grow(self, seq: SeqId, tokens: list) -> None:
        self.lengths[seq] += len(tokens)
        self.computed.discard(seq)

    def preempt(self, seq: SeqId) -> None:
        self.status[seq] = Status.PREEMPTED
        self.computed.discard(seq)

    def decode(self, token: int) -> None:
        for seq in self.computed_ids():
            self.lengths[seq] += 1
        self.step()

    def fork(self, parent: SeqId, child: SeqId) -> None:
        self.status[child], self.lengths[child] = Status.RUNNING, self.lengths[parent]
        self.computed.add(child)

    def swap_out(self, seq: SeqId) -> None:
        self.status[seq] = Status.SWAPPED

    def swap_in(self, seq: SeqId) -> None:
        self.status[seq] = Status.RUNNING

    def free(self, seq: SeqId) -> None:
        del self.status[seq], self.lengths[seq]
        self.computed.discard(seq)
        self.finished.append(seq)

    def rollback(self, seq: SeqId, num_tokens: int) -> None:
        self.lengths[seq] -= min(num_tokens, self.rollback_limit(seq))

    def evict(self, num_blocks: int) -> None:
        pass

    def reset_cache(self) -> None:
        pass

    def misuse(self, call: object) -> None:
        pass


_CONFIG = MachineConfig(num_blocks=64, num_host_blocks=32)
_CAPS = paged_allocator(PoolSpec(_CONFIG.block_size, _CONFIG.num_blocks, _CONFIG.num_host_blocks)).capabilities


class BareMachine(RuleBasedStateMachine):
    """kvfuzz's rules, built from the same operation table (enablement and argument strategies), doing bookkeeping
    only."""

    steps = 0

    def __init__(self) -> None:
        super().__init__()
        self.bare = BareState(_CAPS, _CONFIG.block_size, _CONFIG.num_host_blocks)  # performs the operations
        self.expected: ProgramState = self.bare  # what the operation table reads: checked against the protocol


def _bare_rule(operation: Operation) -> Callable[..., None]:
    def perform(self: BareMachine, **arguments: object) -> None:
        BareMachine.steps += 1
        getattr(self.bare, operation.name)(**arguments)

    perform.__name__ = perform.__qualname__ = operation.name
    strategies: dict[str, SearchStrategy[Any]] = {name: argument.strategy() for name, argument in operation.arguments}
    # rule()'s overloads single out its target/targets keywords, which a dict of strategies cannot rule out.
    as_rule = cast(Callable[..., Callable[[Callable[..., None]], Callable[..., None]]], rule)
    return precondition(lambda self: operation.enabled(self.expected))(as_rule(**strategies)(perform))


for _operation in OPERATIONS:
    setattr(BareMachine, _operation.name, _bare_rule(_operation))


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


def campaign_worker_steps_per_second(seconds: float) -> float:
    """A one-worker campaign against kvfuzz's allocator: the steps/s its worker process reports."""
    limits = probe_limits(DEFAULT_ALLOCATOR, load_factory(DEFAULT_ALLOCATOR), MachineConfig())
    with tempfile.TemporaryDirectory() as corpus:
        result = run_campaign(
            CampaignOptions((DEFAULT_ALLOCATOR,), (limits,), 1, Path(corpus), duration=seconds, seed=0)
        )
    if result.findings:
        raise SystemExit(f"the correct allocator failed in a campaign: {[finding.text for finding in result.findings]}")
    return result.steps_per_second


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
    parser.add_argument(
        "--campaign-seconds", type=float, default=20, help="the one-worker campaign's duration (default 20)"
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    figures: dict[str, float] = {}
    figures["bare_64"] = median_of(args.repeats, lambda: bare_steps_per_second(args.examples, args.steps))
    for num_blocks in (64, 1024, 16384):
        figures[f"full_{num_blocks}"] = median_of(
            args.repeats, functools.partial(full_steps_per_second, args.examples, args.steps, num_blocks)
        )
    figures["kvfuzz_run_64"] = median_of(
        args.repeats, lambda: full_steps_per_second(args.examples, args.steps, 64, args.examples // 2)
    )
    kernels = args.kernels.split(",")
    for kernel in kernels:
        figures[f"kernel_{kernel}_64"] = median_of(
            args.repeats, functools.partial(full_steps_per_second, args.examples, args.steps, 64, kernel=kernel)
        )
    figures["campaign_worker"] = median_of(
        args.repeats, lambda: campaign_worker_steps_per_second(args.campaign_seconds)
    )
    figures["full_over_bare"] = figures["full_64"] / figures["bare_64"]
    figures["worker_over_bare"] = figures["campaign_worker"] / figures["bare_64"]
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
    print(
        f"  a campaign worker (1 worker, {args.campaign_seconds:g} s, swarmed pools):        "
        f"{figures['campaign_worker']:8.0f} steps/s"
    )
    print(f"  full / bare at 64 blocks:  {figures['full_over_bare']:.2f}  (target >= 0.75)")
    print(f"  campaign worker / bare:    {figures['worker_over_bare']:.2f}  (target >= 0.75)")
    print(f"  16384 vs 64 blocks:        {100 * figures['slowdown_16384_vs_64']:+.1f}% slower  (target <= 20%)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=2)


if __name__ == "__main__":
    main()
