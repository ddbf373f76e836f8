"""Shrinking a failing program to a fixpoint of every pass, within a time bound, with restarts from other failing
programs (the passes and their order are described in :mod:`kvfuzz.shrink`)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, TypeVar

import attrs

from kvfuzz.engine.config import MachineConfig
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Safeguards
from kvfuzz.program.safeguards import AllocatorHang
from kvfuzz.program.stats import RunStats
from kvfuzz.registry import AllocatorFactory
from kvfuzz.shrink.candidates import Best, Pools, PoolShrinker, Shrinker
from kvfuzz.shrink.configuration import simplify_config, smaller_pool_fewer_calls
from kvfuzz.shrink.deletions import delete_calls, delete_distant_pairs, merge_calls
from kvfuzz.shrink.restarts import LONG_PROGRAM, RESTARTS, Failing, Restarts, another_program
from kvfuzz.shrink.signature import Signature
from kvfuzz.shrink.simplify import renumber, simplify_arguments, simplify_shared_values

ShrinkerT = TypeVar("ShrinkerT", bound=Shrinker)


@attrs.frozen
class Shrunk:
    """The smallest program (and configuration) found failing with the same signature; ``stopped_early`` says why
    shrinking ended before its fixpoint (None: it reached it)."""

    config: MachineConfig
    calls: tuple[Call, ...]
    failure: BaseException  # what the final program raised on its last replay
    replays: int  # candidate programs replayed
    stopped_early: Optional[str] = None
    restarts: int = 0  # other failing programs shrunk from (the result is the shortest of every fixpoint)
    others: tuple[Failing, ...] = ()  # failures of other signatures met while searching for restarts, one each


Pass = Callable[[ShrinkerT, Best], Best]
"""One pass: the program it was given, or a smaller one failing with the shrink's signature."""

CALL_STAGES: tuple[tuple[Pass[Shrinker], ...], ...] = (
    (delete_calls, simplify_arguments, simplify_shared_values, renumber),
    (delete_distant_pairs, merge_calls),
)
"""The passes of a shrink in the configuration the failure was found in, in stages (see :func:`_fixpoint`)."""

POOL_STAGES: tuple[tuple[Pass[PoolShrinker], ...], ...] = (
    (simplify_config, *CALL_STAGES[0]),
    (*CALL_STAGES[1], smaller_pool_fewer_calls),
)
"""The passes of a shrink that may change the configuration: the configuration is simplified first (a smaller pool
makes every later replay cheaper), and a smaller pool with one call fewer comes last."""


HUNG_REPLAYS = 10
"""A hang's shrink may spend the watchdog's limit on this many replays beyond its time bound: every candidate that
keeps the hang (and the program's own replay) costs that long."""


def shrink(
    factory: AllocatorFactory,
    config: MachineConfig,
    calls: Sequence[Call],
    failure: BaseException,
    signature: Signature,
    *,
    seconds: float,
    pools: Optional[Pools] = None,
    safeguards: Safeguards = Safeguards(),
    stop: Callable[[], bool] = lambda: False,
    stats: Optional[RunStats] = None,
    restarts: Optional[Restarts] = None,
) -> Shrunk:
    """Shrink ``calls`` under ``config`` (which fail with ``signature``) to a fixpoint of every pass, within
    ``seconds`` (a hang's, :data:`HUNG_REPLAYS` times its watchdog's limit more): in ``config`` itself, or with
    ``pools`` in any configuration they allow. With ``restarts``, a fixpoint longer than :data:`LONG_PROGRAM` calls
    is shrunk again from other failing programs. Each replay runs under ``safeguards``: with a watchdog, a candidate
    that hangs ends at its limit, and is kept only if the failure is a hang in the same operation."""
    if isinstance(failure, AllocatorHang):
        seconds += HUNG_REPLAYS * failure.seconds
    if pools is None:
        shrinker = Shrinker(config, factory, signature, safeguards, seconds, stop, stats)
        return _shrink(shrinker, CALL_STAGES, (config, tuple(calls), failure), restarts)
    in_pools = PoolShrinker(config, factory, signature, safeguards, seconds, stop, stats, pools)
    return _shrink(in_pools, POOL_STAGES, (config, tuple(calls), failure), restarts)


def _shrink(
    shrinker: ShrinkerT, stages: Sequence[Sequence[Pass[ShrinkerT]]], best: Best, restarts: Optional[Restarts]
) -> Shrunk:
    shrinker.fails(best[0], best[1])  # its run steers the first candidates (the landmarks)
    best, stopped = _fixpoint(shrinker, stages, best)
    others: list[Failing] = []
    started = 0
    while restarts is not None and stopped is None and len(best[1]) > LONG_PROGRAM and started < RESTARTS:
        found = another_program(shrinker, best[0], best[1], restarts, others)
        if found is None:
            break
        started += 1
        candidate, candidate_stopped = _fixpoint(shrinker, stages, found)
        if len(candidate[1]) < len(best[1]):
            best, stopped = candidate, candidate_stopped
        elif candidate_stopped is not None:
            break  # out of time: the best so far did reach its fixpoint
    note = None if stopped is None else f"shrinking stopped early: {stopped}"
    return Shrunk(best[0], best[1], best[2], shrinker.replays, note, started, tuple(others))


def _fixpoint(
    shrinker: ShrinkerT, stages: Sequence[Sequence[Pass[ShrinkerT]]], best: Best
) -> tuple[Best, Optional[str]]:
    """Every pass until none changes anything; with why it stopped before that (None: the fixpoint)."""
    # The first passes run to their fixpoint before the others are tried: those move a program from one fixpoint
    # of the first to another, and never lengthen it, so a shrink never ends longer than the first passes alone.
    while True:
        before = best[:2]
        for stage in stages:
            for shrink_pass in stage:
                if shrinker.out_of_time():
                    return best, shrinker.why_stopped()
                best = shrink_pass(shrinker, best)
            if best[:2] != before:
                break
        if best[:2] == before:
            return best, None
