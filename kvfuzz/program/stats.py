"""Counters a run keeps across all its examples: operations exercised, examples, steps, and the first failure."""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Optional

import attrs

from kvfuzz.accounting.occupancy import OccupancyLog
from kvfuzz.program.call import Call
from kvfuzz.program.failures import FailureKind, failure_kind


@attrs.define
class RunStats:
    """Mutable tallies of one run. ``operations`` counts every operation and outcome by name; ``occupancy`` samples
    the device pool after every step of every example.

    Invariant kept: ``best_program`` is the shortest program seen failing like the run's first failure
    (``first_kind``), so an interrupted shrink still has the best failure found so far.
    """

    operations: Counter[str] = attrs.field(factory=Counter)
    swarms: set[tuple[str, ...]] = attrs.field(factory=set)  # the distinct operation subsets random programs drew
    occupancy: OccupancyLog = attrs.field(factory=OccupancyLog)
    examples: int = 0  # programs started before the first failure (the search)
    shrink_runs: int = 0  # programs started after it (shrinking and confirming)
    steps: int = 0  # calls executed, in every program
    started: float = attrs.field(factory=time.perf_counter)
    phase: str = "random programs"  # what the run is doing now, for progress lines
    first_failure_examples: Optional[int] = None
    first_failure_seconds: Optional[float] = None
    first_kind: Optional[FailureKind] = None  # the kind of the first failure
    best_program: Optional[list[Call]] = None
    best_failure: Optional[BaseException] = None
    last_failing_program: Optional[list[Call]] = None
    declared_window: Optional[int] = None  # the in-flight window W the allocator of the latest example declared
    on_step: Optional[Callable[["RunStats"], None]] = None

    def example_started(self, declared_window: int) -> None:
        """A program starts, against an allocator that declares ``declared_window``."""
        self.declared_window = declared_window
        if self.first_kind is None:
            self.examples += 1
        else:
            self.shrink_runs += 1

    def count_step(self) -> None:
        self.steps += 1
        if self.on_step is not None:
            self.on_step(self)

    def failed(self, program: list[Call], error: BaseException) -> None:
        """A program failed: remember when the run's first failure happened (before any shrinking), the program of
        the latest failing example (after shrinking, Hypothesis runs the minimal one last, to report it), and the
        shortest program that fails like the first."""
        self.last_failing_program = list(program)
        kind = failure_kind(error)
        if self.first_kind is None:
            self.first_kind = kind
            self.first_failure_examples = self.examples
            self.first_failure_seconds = time.perf_counter() - self.started
        if kind == self.first_kind and (self.best_program is None or len(program) <= len(self.best_program)):
            self.best_program, self.best_failure = list(program), error
