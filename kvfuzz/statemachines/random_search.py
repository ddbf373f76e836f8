"""Random programs over the machine's rules, run without Hypothesis.

Plain random programs (every enabled rule equally likely, arguments drawn like the machine draws them, lengths
uniform up to the step budget) reach many allocator bugs in fewer examples than Hypothesis's generation, which
starts from the simplest programs and switches rules off per example. kvfuzz therefore spends the first examples of
a run on random programs; a failure among them is shrunk by replay (deleting calls) and reported like any other.
The programs are made of the machine's own rule calls, so they print, save and replay the same way.
"""

from __future__ import annotations

import random
from typing import Callable, Optional

import attrs

from kvfuzz.statemachines.machine import KVCacheMachine, _computed, _preemptible, _rollbackable, _running
from kvfuzz.statemachines.misuse import misuse_calls
from kvfuzz.statemachines.model import Status
from kvfuzz.statemachines.program import Call
from kvfuzz.statemachines.strategies import NAMESPACES, VOCABULARY, system_prompts


@attrs.frozen
class RandomFailure:
    """The first failing random program: its calls and what it raised."""

    calls: tuple[Call, ...]
    failure: Exception


def _choices(machine: KVCacheMachine, rng: random.Random) -> list[tuple[str, Callable[[], dict]]]:
    """The rules enabled now (the machine's preconditions), each with a draw of its arguments."""
    h, caps, size = machine.harness, machine.caps, machine.config.block_size
    pick = rng.choice

    def tokens(low: int, high: int) -> list[int]:
        return [rng.randrange(VOCABULARY) for _ in range(rng.randint(low, high))]

    choices: list[tuple[str, Callable[[], dict]]] = [
        (
            "admit",
            lambda: {
                "seq": h.new_id(),
                "namespace": pick(NAMESPACES) if caps.namespaces else (),
                "system": pick(system_prompts(size)),
                "suffix": tokens(1, size + 2),
            },
        ),
        ("step", dict),
    ]
    running, computed, rollbackable = _running(h), _computed(h), _rollbackable(h)
    if h.ids(Status.PREEMPTED):
        choices.append(("readmit", lambda: {"seq": pick(h.ids(Status.PREEMPTED))}))
    if running:
        choices.append(
            (
                "grow",
                lambda: {"seq": pick(running), "tokens": tokens(1, 1) if rng.random() < 0.5 else tokens(2, size + 1)},
            )
        )
    preemptible = _preemptible(h)
    if preemptible:
        choices.append(("preempt", lambda: {"seq": pick(preemptible)}))
    if computed:
        choices.append(("decode", lambda: {"token": rng.randrange(VOCABULARY)}))
        if caps.fork:
            choices.append(("fork", lambda: {"parent": pick(computed), "child": h.new_id()}))
        if caps.swap and h.num_host_blocks:
            choices.append(("swap_out", lambda: {"seq": pick(computed)}))
    live = [seq for seq, model in h.seqs.items() if model.status is not Status.PREEMPTED]
    if live:
        choices.append(("free", lambda: {"seq": pick(live)}))
    if h.ids(Status.SWAPPED):
        choices.append(("swap_in", lambda: {"seq": pick(h.ids(Status.SWAPPED))}))
    if caps.rollback and rollbackable:
        choices.append(("rollback", lambda: {"seq": pick(rollbackable), "num_tokens": rng.randint(1, 6)}))
    if caps.eviction and h.finished:
        choices += [("evict", lambda: {"num_blocks": rng.randint(1, 4)}), ("reset_cache", dict)]
    if h.seqs or h.finished:
        choices.append(("misuse", lambda: {"call": pick(misuse_calls(h))}))
    return choices


def random_search(
    machine_class: type[KVCacheMachine], *, examples: int, steps: int, seed: Optional[int]
) -> Optional[RandomFailure]:
    """Run up to ``examples`` random programs of up to ``steps`` calls; return the first that fails."""
    rng = random.Random(seed)
    for _ in range(examples):
        machine = machine_class()
        try:
            for _ in range(rng.randint(1, steps)):
                rule, draw = rng.choice(_choices(machine, rng))
                getattr(machine, rule)(**draw())
            machine.teardown()
        except Exception as error:  # noqa: BLE001 -- any failure is the finding, as for the machine
            return RandomFailure(tuple(machine.calls), error)
    return None
