"""Running a program against one allocator: each call is looked up in the operation table, recorded, counted, and
performed by the engine.

The Hypothesis machine, random programs and replay all run programs through :class:`Execution`, so a call is
recorded, journalled, watched and counted the same way whoever drew it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional

import attrs

from kvfuzz.engine.config import MachineConfig, config_json
from kvfuzz.engine.engine import Engine
from kvfuzz.engine.violations import InvariantViolation, violation
from kvfuzz.program.call import Call, program_json
from kvfuzz.program.operations import BY_NAME
from kvfuzz.program.safeguards import AllocatorHang, Journal, UserInterrupt, Watchdog, escaped
from kvfuzz.program.stats import RunStats
from kvfuzz.registry import AllocatorFactory


@attrs.frozen
class Safeguards:
    """What a run adds around every call so that no failure is lost: a journal of the program (None: none kept)
    and a watchdog on each operation (None: calls may take any time)."""

    journal: Optional[Journal] = None
    watchdog: Optional[Watchdog] = None


class Execution:
    """One program being run against one allocator: the engine, the calls made so far, and the run's counters.

    Invariant kept: ``calls`` lists every call started, in order, including one that raised; ``failed`` is set once
    a call has raised (or the user interrupted one), after which the engine's state is not trusted and teardown
    skips its checks.
    """

    def __init__(self, engine: Engine, stats: Optional[RunStats] = None, safeguards: Safeguards = Safeguards()) -> None:
        self.engine = engine  # the allocator under test, and kvfuzz's model of it
        self.stats = stats  # the run's counters, shared by every example of the run
        self.safeguards = safeguards  # journal and watchdog
        self.calls: list[Call] = []  # the program so far
        self.failed = False  # a call raised or was interrupted
        if stats is not None:
            stats.example_started(engine.caps.inflight_window)
        if safeguards.journal is not None:
            config = engine.config
            safeguards.journal.begin_example({"config": config_json(config, config.inflight_window)})

    def accepts(self, call: Call) -> bool:
        """Whether ``call`` could have been drawn in the current state (its operation enabled, its arguments ones
        the operation could draw now)."""
        operation = BY_NAME.get(call.rule)
        return operation is not None and operation.accepts(self.engine.expected, call.kwargs())

    def execute(self, name: str, arguments: Mapping[str, Any]) -> None:
        """Record, journal and count the call, then perform it under the watchdog; a failure is noted with the
        program that led to it."""
        call = Call(name, arguments)
        self.calls.append(call)
        if self.safeguards.journal is not None:
            self.safeguards.journal.call(program_json((call,))[0])
        if self.stats is not None:
            self.stats.count_step()
        self._guarded(call, functools.partial(BY_NAME[name].apply, self.engine, **arguments))

    def teardown(self) -> None:
        """Invariant 10 once every sequence is gone; skipped after a failure, whose state is already broken. The
        pools are released either way, so a run's memory does not wait for the garbage collector."""
        try:
            if not self.failed:
                self._guarded("teardown (quiesce)", self._quiesce)
        finally:
            self.engine.close()

    def _quiesce(self) -> None:
        """The engine's teardown, with a violation it finds blamed on the teardown: the sequences it frees are freed
        by the teardown, not by a call of the program, which an explanation naming ``free('s0')`` alone would
        suggest. The violation keeps its type and traceback, so Hypothesis sees the same failure."""
        try:
            self.engine.quiesce()
            return
        except InvariantViolation as found:
            blamed, traceback = at_teardown(found), found.__traceback__
        raise blamed.with_traceback(traceback)  # outside the handler: no second exception chained to the first

    def _guarded(self, operation: object, perform: Callable[[], object]) -> None:
        """Run one operation under the watchdog (``operation`` names it in a hang report: a call, printed only
        then). A failure marks the execution failed and is counted with its program; a ``BaseException`` the
        allocator lets out is reported as its crash (:class:`~kvfuzz.program.safeguards.AllocatorEscape`), never as
        the user's interrupt; an operation that returns past its deadline (its interrupt swallowed) is a hang all
        the same. A plain try, not a context manager: it runs around every call."""
        watchdog = self.safeguards.watchdog
        if watchdog is not None:
            watchdog.arm(operation)
        try:
            perform()
        except BaseException as raised:
            overdue = watchdog is not None and watchdog.disarm()
            error = escaped(raised)
            if overdue and not isinstance(error, (AllocatorHang, UserInterrupt)):
                assert watchdog is not None
                error = watchdog.hang()
            self._failed(error)
            if error is raised:
                raise
            raise error from raised
        if watchdog is not None and watchdog.disarm():
            hang = watchdog.hang()
            self._failed(hang)
            raise hang

    def _failed(self, error: BaseException) -> None:
        self.failed = True
        if self.stats is not None and not isinstance(error, UserInterrupt):
            self.stats.failed(self.calls, error)


@attrs.frozen
class Target:
    """What programs run against: an allocator factory, the configuration to build it and its engine with, the
    run's counters (None when nothing counts) and its safeguards."""

    factory: AllocatorFactory
    config: MachineConfig = MachineConfig()
    stats: Optional[RunStats] = attrs.field(default=None, eq=False)
    safeguards: Safeguards = attrs.field(default=Safeguards(), eq=False)

    def start(self) -> Execution:
        """A fresh allocator and engine, ready for a program's first call. A factory that lets a ``BaseException``
        out of a later build (the first one is checked before any run) is the allocator's crash, as an operation's
        is (:func:`~kvfuzz.program.safeguards.escaped`): ``sys.exit`` there never ends kvfuzz with its status."""
        stats = self.stats
        try:
            allocator = self.factory(self.config.pool_spec())
        except BaseException as raised:
            error = escaped(raised)
            if error is raised:
                raise
            raise error from raised
        engine = Engine(
            allocator,
            self.config,
            stats.operations if stats is not None else None,
            on_step=stats.occupancy.record if stats is not None else None,
        )
        return Execution(engine, stats, self.safeguards)


TEARDOWN_OPERATION = "the teardown's "
"""How an explanation names an operation the teardown performed: ``the teardown's free('s0')``."""


def at_teardown(found: InvariantViolation) -> InvariantViolation:
    """``found``, raised while the teardown performed an operation, as the teardown's."""
    return violation(
        found.invariant, TEARDOWN_OPERATION + found.operation, found.step, found.summary, found.details, found.cause
    )
