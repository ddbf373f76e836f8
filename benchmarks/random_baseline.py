"""The baseline a user might write instead of kvfuzz's machine: random operation sequences of the same length, with
the same operations, argument distributions and checks (kvfuzz's harness), but no Hypothesis: no guidance, no
swarm of enabled rules, no shrinking."""

from __future__ import annotations

import random
import time
from typing import Callable, Optional

import attrs

from kvfuzz.statemachines import Harness, MachineConfig
from kvfuzz.statemachines.machine import AllocatorFactory
from kvfuzz.statemachines.misuse import misuse_calls
from kvfuzz.statemachines.model import Status
from kvfuzz.statemachines.strategies import NAMESPACES, VOCABULARY, system_prompts


@attrs.frozen
class BaselineResult:
    """When the first failure came (examples, seconds) and how many operations its program ran; None if none."""

    examples: Optional[int]
    seconds: Optional[float]
    program_length: Optional[int]
    invariant: Optional[str]


def _tokens(rng: random.Random, count: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCABULARY) for _ in range(count))


def _operations(h: Harness, rng: random.Random) -> list[Callable[[], object]]:
    """The operations enabled now, with arguments drawn as the machine draws them."""
    size = h.block_size
    running, computed = h.ids(Status.RUNNING), h.computed_ids()
    rollbackable = [seq for seq in running if h.rollback_limit(seq) >= 1]

    def admit() -> object:
        system = rng.choice(system_prompts(size))
        prompt = system + _tokens(rng, rng.randint(1, size + 2))
        namespace = rng.choice(((),) + NAMESPACES) if h.caps.namespaces else ()
        return h.admit(h.new_id(), namespace, prompt)

    def decode() -> object:
        token = rng.randrange(VOCABULARY)
        for seq in h.computed_ids():
            h.grow(seq, (token,))
        return h.step()

    ops: list[Callable[[], object]] = [admit, h.step]
    if h.ids(Status.PREEMPTED):
        ops.append(lambda: h.readmit(rng.choice(h.ids(Status.PREEMPTED))))
    if running:
        ops += [lambda: h.grow(rng.choice(running), _tokens(rng, 1 if rng.random() < 0.5 else rng.randint(2, size + 1))),
                lambda: h.preempt(rng.choice(running))]
    if computed:
        ops.append(decode)
        if h.caps.fork:
            ops.append(lambda: h.fork(rng.choice(computed), h.new_id()))
        if h.caps.swap and h.num_host_blocks:
            ops.append(lambda: h.swap_out(rng.choice(computed)))
    if any(model.status is not Status.PREEMPTED for model in h.seqs.values()):
        ops.append(lambda: h.free(rng.choice([s for s, m in h.seqs.items() if m.status is not Status.PREEMPTED])))
    if h.ids(Status.SWAPPED):
        ops.append(lambda: h.swap_in(rng.choice(h.ids(Status.SWAPPED))))
    if h.caps.rollback and rollbackable:
        seq = rng.choice(rollbackable)
        ops.append(lambda: h.rollback(seq, min(rng.randint(1, 6), h.rollback_limit(seq))))
    if h.caps.eviction and h.finished:
        ops += [lambda: h.evict(rng.randint(1, 4)), h.reset_cache]
    if h.seqs or h.finished:
        ops.append(lambda: h.misuse(rng.choice(misuse_calls(h))))
    return ops


def first_failure(factory: AllocatorFactory, config: MachineConfig, *, seed: int, examples: int,
                  steps: int) -> BaselineResult:
    """Run random programs of ``steps`` operations until one fails or ``examples`` have passed."""
    rng = random.Random(seed)
    started = time.perf_counter()
    for example in range(1, examples + 1):
        h = Harness(factory(config.pool_spec()), config)
        executed = 0
        try:
            for _ in range(rng.randint(1, steps)):
                executed += 1
                rng.choice(_operations(h, rng))()
            h.quiesce()
        except Exception as error:  # noqa: BLE001 -- any failure counts, as it would for the machine
            invariant = str(getattr(error, "invariant", f"crash ({type(error).__name__})"))
            return BaselineResult(example, time.perf_counter() - started, executed, invariant)
    return BaselineResult(None, None, None, None)
