"""Restarts: a fixpoint is local, so a program still long at its fixpoint is shrunk again from other failing
programs, random programs of the campaign's swarm that fail with the same signature."""

from __future__ import annotations

import random
from typing import Optional

import attrs

from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.operation import Operation
from kvfuzz.program.call import Call
from kvfuzz.program.operations import BY_NAME
from kvfuzz.program.random_programs import random_program
from kvfuzz.program.safeguards import AllocatorHang
from kvfuzz.shrink.candidates import Best, Shrinker
from kvfuzz.shrink.signature import Signature, signature_of

LONG_PROGRAM = 5
"""A program longer than this many calls at its fixpoint is shrunk again from other failing programs (restarts)."""

RESTARTS = 3
"""Other failing programs one shrink starts from, at most."""

RESTART_SEARCH = 200
"""Random programs a restart tries to find one that fails with the same signature, before restarts give up."""

RESTART_SHORTEST = 8
"""The length of a restart search's first program; each next one may be a call longer, up to the swarm's program
length: a short failing program is a better start (and a short passing one a cheap miss)."""


@attrs.frozen
class Restarts:
    """Where a shrink finds other programs failing the same way: random programs of a campaign's swarm."""

    operations: tuple[Operation, ...]  # the swarm's operations
    program_length: int  # the swarm's program length
    rng: random.Random = attrs.field(eq=False)  # a stream of its own (the worker's seeds it from the signature)


@attrs.frozen
class Failing:
    """A failing program a restart search met with another signature than the one being shrunk (one per
    signature)."""

    config: MachineConfig
    calls: tuple[Call, ...]
    failure: BaseException
    signature: Signature  # as the program's own run named it


def another_program(
    shrinker: Shrinker, config: MachineConfig, calls: tuple[Call, ...], restarts: Restarts, others: list[Failing]
) -> Optional[Best]:
    """A random program of the swarm (with the operations ``calls`` make too: a program found by Hypothesis draws
    from every rule) that fails with the signature, or None (none within :data:`RESTART_SEARCH` programs, out of
    time, or a hang); drawn under ``config`` and, every other time, under the configuration the failure was found in
    (a simpler pool can make the failure rare: no host blocks leaves no swap to free blocks with). A failure of
    another signature goes to ``others`` (once per signature)."""
    operations = tuple(dict.fromkeys((*restarts.operations, *(BY_NAME[call.rule] for call in calls))))
    configs = tuple(dict.fromkeys((config, shrinker.found_in)))
    for attempt in range(RESTART_SEARCH):
        if shrinker.out_of_time():
            return None
        config = configs[attempt % len(configs)]
        length = min(restarts.program_length, RESTART_SHORTEST + attempt)
        found = random_program(shrinker.target(config), restarts.rng, length, operations)
        if found is None:
            continue
        if isinstance(found.failure, AllocatorHang):  # every further program may hang too: no more restarts
            hang, hung = found.failure, found.calls
            others.append(Failing(config, hung, hang, signature_of(shrinker.signature.allocator, hang, hung, None)))
            return None
        kept, met = shrinker.judged(config, found.calls)
        if kept is not None:
            return config, kept.calls, kept.failure
        if met is None:  # its replay passed or could not be built: signed as the search met it
            met = signature_of(shrinker.signature.allocator, found.failure, found.calls, None)
        if met != shrinker.signature and all(met != other.signature for other in others):
            others.append(Failing(config, found.calls, found.failure, met))
    return None
