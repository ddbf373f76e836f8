"""``kvfuzz campaign --scheduler sglang``'s target: SGLang's scheduling pieces (:mod:`kvfuzz.scheduler.sglang`),
its batches drawn from SGLang's swarm table, its failures saved as ``sglang`` traces (imported lazily)."""

from __future__ import annotations

import contextlib
from typing import Optional

from kvfuzz.campaign.scheduler.target import SchedulerTarget
from kvfuzz.program.safeguards import Journal, Watchdog
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.machine import Witness
from kvfuzz.scheduler.replay import bounded_replay
from kvfuzz.scheduler.search import Outcome, search
from kvfuzz.scheduler.sglang import swarm as sglang_swarm
from kvfuzz.scheduler.sglang.traces import SGLangFailureRecorder, sglang_version
from kvfuzz.scheduler.swarm import SwarmConfig


def sglang_target(name: str) -> SchedulerTarget:
    """SGLang 0.5.23's SchedulePolicy, PrefillAdder and ScheduleBatch over its radix cache."""
    return SchedulerTarget(
        name,
        _validate,
        _search,
        bounded_replay,
        SGLangFailureRecorder,
        sglang_swarm.SGLANG_DIMENSIONS,  # the table as it is when the target is made
        version=sglang_version,
    )


def _validate(setup: SchedulerSetup, runner: str) -> None:
    from kvfuzz.scheduler.sglang.build import setup_problem, sglang

    sglang()  # imported once, in the campaign's process, before any batch: isolated batches fork it imported
    problem = setup_problem(setup)
    if problem is not None:
        raise ValueError(problem)


def _search(
    config: SwarmConfig,
    examples: int,
    seed: int,
    shrink: bool,
    witness: Optional[Witness],
    call_timeout: Optional[float],
    journal: Optional[Journal],
) -> Outcome:
    """One batch, each step bounded by a watchdog of ``call_timeout`` seconds (None: none), each example's program
    kept in ``journal`` (an isolated batch's)."""
    from kvfuzz.scheduler.sglang.session import SGLangSession

    setup = config.setup
    with Watchdog(call_timeout) if call_timeout is not None else contextlib.nullcontext() as watchdog:
        return search(
            setup,
            examples,
            config.steps,
            shrink=shrink,
            witness=witness,
            session=lambda: SGLangSession(setup, watchdog=watchdog, journal=journal),
            name="SGLangSchedulerMachine",
            seed=seed,
        )
