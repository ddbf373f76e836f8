"""The scheduler target's speed against the engine's own cost: the same client programs played on vLLM's bare
engine loop (its ``Scheduler``'s ``schedule()`` and ``update_from_output()`` with a trivial model runner that samples
token 1 for every request whose prompt is computed; no kvfuzz worker, no checks) and on kvfuzz's scheduler target
with every check on (``kvfuzz.scheduler.session.Session``: the worker's tables, K/V writes, content, exclusive-write,
accounting, output and progress checks), side by side in one process: steps (``schedule()`` calls) per CPU-second
of each, alternating A B A B over ``--repeats`` rounds, and the median of the rounds' ratios.

Programs are drawn from ``--seed``: ``--programs`` programs of ``--operations`` client operations (add a request of
1-12 prompt tokens from a 4-token vocabulary, so prefixes are shared, asking 1-8 outputs; step; abort a request),
then the drain, on the target's default configuration (16 blocks of 4 slots, budget 16, 4 running, prefix
caching). Both sides build a fresh ``Scheduler`` per program. Runs in the vLLM environment, from the repository root.

Usage: PYTHONPATH=$PWD python benchmarks/scheduler_bare.py [--programs N] [--operations N] [--repeats N] [--seed S]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from typing import Any, Callable, Optional

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.program import Abort, AddRequest, Operation, Step
from kvfuzz.scheduler.session import Session, drain_bound
from kvfuzz.scheduler.vllm_build import new_request, new_scheduler, vllm
from kvfuzz.threads import single_threaded_torch

SETUP = SchedulerSetup()
"""The target's default configuration, as ``kvfuzz run --scheduler vllm-v1`` runs it."""


class BareLoop:
    """vLLM's engine loop with a trivial model runner: a ``Client`` (add, abort, step) and a drain, nothing checked."""

    def __init__(self, setup: SchedulerSetup) -> None:
        self.setup = setup
        self.scheduler = new_scheduler(setup)  # the same Scheduler the target builds
        self.steps = 0  # schedule() calls so far
        self.added = 0  # requests added so far (ids r0, r1, ...)
        self.lengths: dict[str, int] = {}  # request -> prompt length + max_tokens

    def add(self, prompt: list[int], max_tokens: int, *args: Any, **kwargs: Any) -> str:
        request = f"r{self.added}"
        self.scheduler.add_request(new_request(request, prompt, max_tokens, self.setup.block_size, self.added))
        self.lengths[request] = len(prompt) + max_tokens
        self.added += 1
        return request

    def abort(self, request: str) -> None:
        self.scheduler.finish_requests(request, vllm().RequestStatus.FINISHED_ABORTED)

    def step(self) -> int:
        output = self.scheduler.schedule()
        self.steps += 1
        order = list(output.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = [
            [1]
            if request in requests and requests[request].num_computed_tokens >= requests[request].num_prompt_tokens
            else []
            for request in order
        ]
        self.scheduler.update_from_output(output, _runner_output(order, sampled))
        return int(output.total_num_scheduled_tokens)

    def drain(self) -> None:
        for _ in range(drain_bound(sum(self.lengths.values()))):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise RuntimeError("the bare loop did not drain: the programs must be ones vLLM serves")


def _runner_output(order: list[str], sampled: list[list[int]]) -> Any:
    """A ``ModelRunnerOutput`` of ``sampled`` tokens per request (with ``req_id_to_index`` where this vLLM has it)."""
    output_class = vllm().ModelRunnerOutput
    fields = {field.name for field in dataclasses.fields(output_class)}
    index = {"req_id_to_index": {request: n for n, request in enumerate(order)}} if "req_id_to_index" in fields else {}
    return output_class(req_ids=order, sampled_token_ids=sampled, **index)


def draw_programs(seed: int, programs: int, operations: int) -> list[list[Operation]]:
    rng = random.Random(seed)
    drawn = []
    for _ in range(programs):
        program: list[Operation] = []
        added = 0
        for _ in range(operations):
            roll = rng.random()
            if roll < 0.35 or added == 0:
                prompt = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
                program.append(AddRequest(prompt, rng.randint(1, 8)))
                added += 1
            elif roll < 0.9:
                program.append(Step())
            else:
                program.append(Abort(f"r{rng.randrange(added)}"))
        drawn.append(program)
    return drawn


def play(make: Callable[[], Any], programs: list[list[Operation]]) -> tuple[int, float]:
    """(schedule() calls, CPU seconds) of every program played on a fresh client and drained."""
    steps = 0
    started = time.process_time()
    for program in programs:
        client = make()
        for operation in program:
            operation.apply(client)
        client.drain()
        steps += client.steps
    return steps, time.process_time() - started


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=40)
    parser.add_argument("--operations", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    programs = draw_programs(args.seed, args.programs, args.operations)
    sides: dict[str, Callable[[], Any]] = {"bare loop": lambda: BareLoop(SETUP), "kvfuzz": lambda: Session(SETUP)}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    with single_threaded_torch():
        for make in sides.values():
            play(make, programs[:2])  # vLLM imported and both paths warm before the clock starts
        counted: dict[str, int] = {}
        for repeat in range(args.repeats):
            order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
            for name in order:
                steps, seconds = play(sides[name], programs)
                counted[name] = steps
                rates[name].append(steps / seconds)
    ratios = [checked / bare for checked, bare in zip(rates["kvfuzz"], rates["bare loop"])]
    print(
        f"{args.programs} programs of {args.operations} operations (seed {args.seed}), then the drain; "
        f"{SETUP.describe()}; {args.repeats} rounds"
    )
    for name, values in rates.items():
        print(
            f"  {name:9}: {counted[name]:6} steps a round, {statistics.median(values):7.0f} steps per CPU-second "
            f"(median; {min(values):.0f}-{max(values):.0f})"
        )
    print(
        f"  kvfuzz / bare loop: {statistics.median(ratios):.2f} (median of the rounds' ratios; "
        f"{min(ratios):.2f}-{max(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
