"""The timeline of a replayed scheduler trace, as immutable records: a lane per request, a column per engine step
(``schedule()`` call), each cell the request's state after that step's scheduling (waiting, running, preempted,
finished, ...), the tokens scheduled for it and the blocks its engine holds for it. The failing step and request
come from the replay's failure. :mod:`kvfuzz.timeline.requests_html` and :mod:`kvfuzz.timeline.requests_png` draw
it; the allocator target's block timeline is :mod:`kvfuzz.timeline.model`."""

from __future__ import annotations

from typing import Mapping, Optional

import attrs

from kvfuzz.scheduler.program import Operation, Step
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.replay_result import SchedulerReplay
from kvfuzz.scheduler.snapshot import RequestAtStep, SnapshotSource, StepSnapshot
from kvfuzz.scheduler.trace import SchedulerTrace

MAX_STEPS = 400
"""The steps a timeline keeps: a longer replay (a hang's drain) is drawn as its last this many steps."""


@attrs.frozen
class ProgramLine:
    """One operation of the client's program, and the steps run before it (where it sits on the time axis)."""

    number: int  # counted from 1, as replay prints the program
    text: str  # the operation as replay prints it
    after_steps: int  # schedule() calls that had run when it ran
    is_step: bool  # a step the client asked for (not an add or an abort)


@attrs.frozen
class RequestTimeline:
    """Lanes are requests in arrival order, columns the steps kept (``steps``, step numbers counted from 1);
    ``cells[lane][column]`` is the request after that step's scheduling, None before it arrived. The failing step
    is a step number (None: the replay passed, or failed before any step), ``failing_request`` the request the
    failure names (None: none)."""

    title: str  # the engine, its version and the configuration
    trace: str  # the trace file, as named
    verdict: str  # reproduced / failed differently / passed
    failure: str  # the replay's failure message ("" when it passed)
    failing_step: Optional[int]
    failing_request: Optional[str]
    requests: tuple[str, ...]
    steps: tuple[int, ...]
    cells: tuple[tuple[Optional[RequestAtStep], ...], ...]
    program: tuple[ProgramLine, ...]
    total_steps: int  # every step the replay ran (more than len(steps) when the window cut it)
    blocks: int  # the pool's blocks, for the reader

    @property
    def failing_column(self) -> Optional[int]:
        """The failing step's column, if it is kept."""
        if self.failing_step is None or self.failing_step not in self.steps:
            return None
        return self.steps.index(self.failing_step)


def block_label(blocks: tuple[int, ...], characters: float) -> str:
    """``blocks`` as ``b3,7,9`` within about ``characters`` characters (the rest counted: ``b3,7+2``)."""
    text = "b" + ",".join(map(str, blocks))
    if len(text) <= characters:
        return text
    shown: list[str] = []
    for block in blocks:
        candidate = "b" + ",".join([*shown, str(block)]) + f"+{len(blocks) - len(shown) - 1}"
        if len(candidate) > characters and shown:
            break
        shown.append(str(block))
    left = len(blocks) - len(shown)
    return "b" + ",".join(shown) + (f"+{left}" if left else "")


class _Recorder:
    """The replay's step observer: keeps every step's snapshot, and the step count before each operation."""

    def __init__(self) -> None:
        self.snapshots: list[StepSnapshot] = []  # one per step, in order
        self.before: list[int] = []  # operation index -> steps run before it

    def stepped(self, session: SnapshotSource, scheduled: Mapping[str, int]) -> None:
        self.snapshots.append(session.snapshot(scheduled))

    def operation(self, index: int, operation: Operation) -> None:
        self.before.append(len(self.snapshots))


def record_requests(trace: SchedulerTrace, path: str) -> RequestTimeline:
    """Replay ``trace`` (every check on) and keep each step's view of its requests. Raises
    :class:`~kvfuzz.scheduler.replay_result.ReplayRefused` as replay does."""
    recorder = _Recorder()
    replayed = replay(trace, on_operation=recorder.operation, observer=recorder)
    return _timeline(trace, path, replayed, recorder)


def _timeline(trace: SchedulerTrace, path: str, replayed: SchedulerReplay, recorder: _Recorder) -> RequestTimeline:
    snapshots = recorder.snapshots[-MAX_STEPS:]
    requests: list[str] = []
    for snapshot in recorder.snapshots:
        requests.extend(request for request in snapshot.requests if request not in requests)
    cells = tuple(tuple(snapshot.requests.get(request) for snapshot in snapshots) for request in requests)
    failure = replayed.failure
    failing_step = None
    if failure is not None and recorder.snapshots:
        failing_step = failure.step if failure.step is not None else len(recorder.snapshots)
    verdict = "passed" if failure is None else "reproduced" if replayed.reproduced else "failed differently"
    program = tuple(
        ProgramLine(index + 1, str(operation), steps, isinstance(operation, Step))
        for index, (operation, steps) in enumerate(zip(trace.program, recorder.before))
    )
    return RequestTimeline(
        title=f"{trace.engine_description()}: {trace.setup.describe()}",
        trace=path,
        verdict=verdict,
        failure=failure.describe() if failure is not None else "",
        failing_step=failing_step,
        failing_request=failure.request if failure is not None else None,
        requests=tuple(requests),
        steps=tuple(snapshot.step for snapshot in snapshots),
        cells=cells,
        program=program,
        total_steps=len(recorder.snapshots),
        blocks=trace.setup.num_blocks,
    )
