"""SGLang scheduler failures as scheduler traces (:mod:`kvfuzz.scheduler.trace`, scheduler ``sglang``): recorded
by the search's witness as the vLLM target's are (the first failing example at once, the shrunk one when the search
ends), and replayed without Hypothesis: a fresh :class:`~kvfuzz.scheduler.sglang.session.SGLangSession` of the
trace's configuration, the client's operations in order, then the drain, every check on."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from kvfuzz.program.safeguards import Watchdog
from kvfuzz.scheduler.engines import installed_version
from kvfuzz.scheduler.program import Operation
from kvfuzz.scheduler.recorder import FailureRecorder
from kvfuzz.scheduler.replay_result import ReplayRefused, SchedulerReplay, replay_program
from kvfuzz.scheduler.snapshot import NO_OBSERVER, StepObserver
from kvfuzz.scheduler.trace import SGLANG, RecordedFailure, SchedulerTrace


def sglang_version() -> str:
    """The installed SGLang's version (without importing it)."""
    return installed_version("sglang")


def missing_sglang(trace: SchedulerTrace) -> str:
    """Why ``trace`` cannot be replayed where SGLang is not installed, and what to do about it."""
    return (
        f"a {trace.scheduler} trace needs sglang {trace.vllm_version}, which is not installed here; build its "
        "environment with scripts/third_party_env.sh sglang"
    )


class SGLangFailureRecorder(FailureRecorder):
    """The vLLM target's recorder for SGLang's sessions: the trace names SGLang's version and no model runner."""

    def __init__(self, scheduler: str, directory: Path) -> None:
        super().__init__(scheduler, directory)
        self._version = sglang_version()

    def _trace(self, session: Any, error: BaseException, shrunk: bool) -> SchedulerTrace:
        program: tuple[Operation, ...] = tuple(session.program)
        return SchedulerTrace(SGLANG, session.setup, "", self._version, program, RecordedFailure.of(error), shrunk)


def replay_sglang(
    trace: SchedulerTrace,
    on_operation: Optional[Callable[[int, Operation], None]] = None,
    watchdog: Optional[Watchdog] = None,
    observer: StepObserver = NO_OBSERVER,
) -> SchedulerReplay:
    """Replay an ``sglang`` trace against the installed SGLang, each step bounded by ``watchdog`` (entered by the
    caller) when one is given and told to ``observer`` as soon as it is scheduled. Raises :class:`ReplayRefused`
    when SGLang is not installed or the trace's configuration is one the SGLang target refuses."""
    from kvfuzz.scheduler.sglang.build import setup_problem, sglang_missing

    if sglang_missing():
        raise ReplayRefused(missing_sglang(trace))
    problem = setup_problem(trace.setup)
    if problem is not None:
        raise ReplayRefused(f"the trace's configuration cannot run: {problem}")
    from kvfuzz.scheduler.sglang.session import SGLangSession

    session = SGLangSession(trace.setup, watchdog=watchdog)
    session.observer = observer
    return replay_program(session, trace, on_operation)
