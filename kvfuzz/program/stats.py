"""Counters a run keeps across all its examples: operations exercised, examples, steps, and the first failure."""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Optional

import attrs

from kvfuzz.accounting.occupancy import OccupancyLog


@attrs.define
class RunStats:
    """Mutable tallies of one run. ``operations`` counts every operation and outcome by name; ``occupancy`` samples
    the device pool after every step of every example."""

    operations: Counter = attrs.field(factory=Counter)
    occupancy: OccupancyLog = attrs.field(factory=OccupancyLog)
    examples: int = 0
    steps: int = 0
    started: float = attrs.field(factory=time.perf_counter)
    first_failure_examples: Optional[int] = None
    first_failure_seconds: Optional[float] = None
    last_failing_program: Optional[list] = None
    on_step: Optional[Callable[["RunStats"], None]] = None

    def count_step(self) -> None:
        self.steps += 1
        if self.on_step is not None:
            self.on_step(self)

    def failed(self, program: list) -> None:
        """A rule raised: remember when the run's first failure happened (before any shrinking), and the program
        of the latest failing example (after shrinking, Hypothesis runs the minimal one last, to report it)."""
        self.last_failing_program = list(program)
        if self.first_failure_examples is None:
            self.first_failure_examples = self.examples
            self.first_failure_seconds = time.perf_counter() - self.started
