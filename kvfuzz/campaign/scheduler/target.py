"""What a scheduler campaign asks of its target.

:class:`SchedulerTarget` is the campaign's whole view of the engine: whether vLLM accepts a configuration, a search
of one batch, and a replay of a saved trace. The real one (:func:`vllm_target`) imports vLLM lazily; the tests of
kvfuzz's own environment pass fakes. What makes two of its failures one finding is
:func:`kvfuzz.scheduler.signature.scheduler_signature`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Optional

import attrs

from kvfuzz.campaign.known import Judged, KnownTrace, Recorded, where_of
from kvfuzz.coverage.scope import Scope
from kvfuzz.program.safeguards import Journal
from kvfuzz.scheduler import swarm
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.machine import Witness
from kvfuzz.scheduler.recorder import FailureRecorder, vllm_version
from kvfuzz.scheduler.replay import ReplayRefused, SchedulerReplay, bounded_replay, model_runner
from kvfuzz.scheduler.search import Outcome, search
from kvfuzz.scheduler.signature import scheduler_signature
from kvfuzz.scheduler.swarm import Dimension, SwarmConfig
from kvfuzz.scheduler.trace import PROCESS_DIED, SchedulerTrace, load

Search = Callable[[SwarmConfig, int, int, bool, Optional[Witness], Optional[float], Optional[Journal]], Outcome]
"""(configuration, examples, Hypothesis seed, shrink, witness, call timeout, journal) -> the batch's outcome."""
Replay = Callable[[SchedulerTrace, Optional[float]], SchedulerReplay]
"""(trace, call timeout) -> what the replay found."""


class SchedulerProcessDied(Exception):
    """The process running a scheduler's program died, or hung past any interrupt and was killed (the exception
    type :data:`PROCESS_DIED` names, which its trace records)."""


@attrs.frozen
class SchedulerTarget:
    """A scheduler a campaign runs: ``validate`` raises ``ValueError`` (one line) for a configuration the engine
    refuses; ``search`` runs one batch; ``replay`` replays a trace."""

    name: str  # --scheduler
    validate: Callable[[SchedulerSetup, str], None]  # (setup, model runner)
    search: Search
    replay: Replay
    recorder: Callable[[str, Path], FailureRecorder] = FailureRecorder  # (name, corpus) -> the batch's witness
    # the swarm table its batches draw from: by default the swarm module's as it is when the target is made
    dimensions: tuple[Dimension, ...] = attrs.field(factory=lambda: swarm.DIMENSIONS)
    version: Callable[[], str] = vllm_version  # the installed engine's version, as its traces record it
    # the code under test whose coverage a campaign measures (None: the engine's, kvfuzz.coverage.scope.SCOPES)
    scope: Optional[Callable[[], Optional[Scope]]] = None


def recorded(setup: SchedulerSetup, model_runner: str) -> Recorded:
    """A scheduler configuration as the closeness of two is measured (:class:`~kvfuzz.campaign.known.Recorded`):
    the model runner protocol, then the setup's fields."""
    return Recorded(model_runner, attrs.asdict(setup))


@attrs.frozen
class SchedulerTraces:
    """The known findings' source (:class:`~kvfuzz.campaign.known.KnownSource`) of a scheduler campaign: the scheduler
    traces recorded against ``target``, each replayed with its own configuration and model runner protocol, under
    the watchdog of ``call_timeout``; a trace whose process died is known as recorded (its replay would kill the
    campaign), and one this engine refuses to replay makes nothing known."""

    target: SchedulerTarget
    call_timeout: Optional[float]
    kind: ClassVar[str] = "scheduler-trace"

    def load(self, path: Path) -> SchedulerTrace:
        return load(path)

    def judge(self, where: str, trace: Any) -> Iterable[Judged]:
        if not isinstance(trace, SchedulerTrace) or trace.scheduler != self.target.name:
            return ()
        entry = KnownTrace(where_of(where, trace.known_bug, trace.fixed), recorded(trace.setup, trace.model_runner))
        if trace.failure.exception == PROCESS_DIED:
            died = SchedulerProcessDied(trace.failure.message)
            return (Judged(scheduler_signature(trace.scheduler, died).key(), entry, bool(trace.fixed)),)
        try:
            replayed = self.target.replay(trace, self.call_timeout)
        except ReplayRefused:
            return ()
        if not replayed.reproduced or replayed.error is None:
            return ()
        return (Judged(scheduler_signature(trace.scheduler, replayed.error).key(), entry, bool(trace.fixed)),)


def vllm_target(name: str) -> SchedulerTarget:
    """vLLM's v1 scheduler (imported on first use)."""
    return SchedulerTarget(name, _validate, _search, bounded_replay)


def _validate(setup: SchedulerSetup, runner: str) -> None:
    from kvfuzz.scheduler.vllm_build import vllm_config

    with model_runner(runner):
        vllm_config(setup)


def _search(
    config: SwarmConfig,
    examples: int,
    seed: int,
    shrink: bool,
    witness: Optional[Witness],
    call_timeout: Optional[float],
    journal: Optional[Journal],
) -> Outcome:
    with model_runner(config.model_runner):
        return search(
            config.setup,
            examples,
            config.steps,
            shrink=shrink,
            witness=witness,
            seed=seed,
            call_timeout=call_timeout,
            journal=journal,
        )
