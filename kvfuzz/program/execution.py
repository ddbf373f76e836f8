"""Running a program against one allocator: each call is looked up in the operation table, recorded, counted, and
performed by the engine.

The Hypothesis machine, random programs and replay all run programs through :class:`Execution`, so a call is
recorded and counted the same way whoever drew it.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import attrs

from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.engine import Engine
from kvfuzz.program.call import Call
from kvfuzz.program.operations import BY_NAME
from kvfuzz.program.stats import RunStats
from kvfuzz.registry import AllocatorFactory


class Execution:
    """One program being run against one allocator: the engine, the calls made so far, and the run's counters.

    Invariant kept: ``calls`` lists every call started, in order, including one that raised; ``failed`` is set once
    a call has raised, after which the engine's state is not trusted (teardown skips its checks).
    """

    def __init__(self, engine: Engine, stats: Optional[RunStats] = None) -> None:
        self.engine = engine  # the allocator under test, and kvfuzz's model of it
        self.stats = stats  # the run's counters, shared by every example of the run
        self.calls: list[Call] = []  # the program so far
        self.failed = False  # a call raised
        if stats is not None:
            stats.examples += 1

    def accepts(self, call: Call) -> bool:
        """Whether ``call`` could have been drawn in the current state (its operation enabled, its arguments ones
        the operation could draw now)."""
        operation = BY_NAME.get(call.rule)
        return operation is not None and operation.accepts(self.engine.expected, call.kwargs())

    def execute(self, name: str, arguments: Mapping[str, Any]) -> None:
        """Record and count the call, then perform it; a failure is noted with the program that led to it."""
        self.calls.append(Call(name, arguments))
        if self.stats is not None:
            self.stats.count_step()
        try:
            BY_NAME[name].apply(self.engine, **arguments)
        except Exception:
            self.failed = True
            if self.stats is not None:
                self.stats.failed(self.calls)
            raise

    def teardown(self) -> None:
        """Invariant 10 once every sequence is gone; skipped after a failure, whose state is already broken."""
        if self.failed:
            return
        try:
            self.engine.quiesce()
        except Exception:
            if self.stats is not None:
                self.stats.failed(self.calls)
            raise


@attrs.frozen
class Target:
    """What programs run against: an allocator factory, the configuration to build it and its engine with, and the
    run's counters (None when nothing counts)."""

    factory: AllocatorFactory
    config: MachineConfig = MachineConfig()
    stats: Optional[RunStats] = attrs.field(default=None, eq=False)

    def start(self) -> Execution:
        """A fresh allocator and engine, ready for a program's first call."""
        stats = self.stats
        engine = Engine(
            self.factory(self.config.pool_spec()),
            self.config,
            stats.operations if stats is not None else None,
            on_step=stats.occupancy.record if stats is not None else None,
        )
        return Execution(engine, stats)
