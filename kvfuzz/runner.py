"""Running the machine against an allocator and summarising what happened, for the CLI, the plugin and scripts.

A run is random programs over the machine's rules, then a Hypothesis campaign under explicit settings. Its summary
counts every operation exercised and, on failure, holds the shrunk program and kvfuzz's explanation of the broken
invariant.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from typing import Callable, Iterator, Optional

import attrs
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.database import ExampleDatabase
from hypothesis.reporting import with_reporter
from hypothesis.stateful import get_state_machine_test

from kvfuzz.accounting.occupancy import OccupancySummary
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.program.call import Call, program_text
from kvfuzz.program.execution import Target
from kvfuzz.program.random_programs import random_search
from kvfuzz.program.replay import minimize, replay
from kvfuzz.program.stats import RunStats
from kvfuzz.registry import DEFAULT_ALLOCATOR, AllocatorFactory, AllocatorNotFound, load_factory
from kvfuzz.statemachines.machine import machine_for

# load_factory and AllocatorNotFound lived here before kvfuzz.registry; exported tests import them from here.
__all__ = ["DEFAULT_ALLOCATOR", "AllocatorNotFound", "RunSummary", "load_factory", "run", "run_settings"]


@contextlib.contextmanager
def single_threaded_torch() -> Iterator[None]:
    """kvfuzz's tensors are tiny: intra-op threads cost more than they save (attention is ~15x slower on two
    threads than on one on a 2-core machine), so a run uses one thread and restores the setting afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_settings(
    examples: int, steps: int, derandomize: bool = True, shrink: bool = True, database: Optional[ExampleDatabase] = None
) -> settings:
    """Explicit settings: no deadline and no health checks (an allocator may be slow), and the example database
    only when one is given."""
    phases = (Phase.explicit, Phase.reuse, Phase.generate) + ((Phase.shrink,) if shrink else ())
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=derandomize,
        database=database,
        print_blob=False,
        report_multiple_bugs=False,
        phases=phases,
        suppress_health_check=list(HealthCheck),
    )


@attrs.frozen
class RunSummary:
    """What one run did, and on failure the shrunk program and why it fails.

    ``first_failure_examples`` and ``first_failure_seconds`` say when the first failing example was met, before
    Hypothesis spent time shrinking it.
    """

    allocator: str
    examples: int
    steps: int
    seconds: float
    failed: bool
    operations: dict[str, int]
    invariant: Optional[str] = None  # display text: "invariant 5 (exclusive writes)", or "crash (KeyError)"
    program: Optional[str] = None
    explanation: Optional[str] = None
    first_failure_examples: Optional[int] = None
    first_failure_seconds: Optional[float] = None
    shrunk: bool = True
    occupancy: Optional[OccupancySummary] = attrs.field(default=None, repr=False)
    violated: Optional[Invariant] = attrs.field(default=None, repr=False)  # None when the failure is a crash
    calls: tuple[Call, ...] = attrs.field(default=(), repr=False)
    failure: Optional[BaseException] = attrs.field(default=None, repr=False)

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0

    @property
    def program_length(self) -> int:
        """Operations in the failing program, shrunk unless ``shrunk`` is false (constructor and teardown not
        counted)."""
        return sum(
            1
            for line in (self.program or "").splitlines()
            if line.startswith("state.") and not line.startswith("state.teardown")
        )

    def to_json(self) -> dict:
        fields = attrs.asdict(
            self, filter=lambda attribute, _: attribute.name not in ("calls", "failure", "occupancy", "violated")
        )
        return {
            **fields,
            "steps_per_second": round(self.steps_per_second, 1),
            "program_length": self.program_length,
            "occupancy": self.occupancy.to_json() if self.occupancy is not None else None,
        }


class Progress:
    """Prints a progress line at most every ``interval`` seconds."""

    def __init__(self, write: Callable[[str], None], interval: float = 1.0) -> None:
        self.write, self.interval = write, interval
        self.last = time.perf_counter()

    def __call__(self, stats: RunStats) -> None:
        now = time.perf_counter()
        if now - self.last >= self.interval:
            self.last = now
            self.write(
                f"  {stats.examples} examples, {stats.steps} steps, {stats.steps / (now - stats.started):.0f} steps/s"
            )


def _shrink_further(target: Target, calls: list[Call], failure: Exception) -> tuple[Exception, list[Call]]:
    """Delete calls the failure (the same broken invariant, or a crash of the same exception type) does not need;
    keep the program as it was if replay disagrees."""
    with single_threaded_torch():
        shorter = minimize(target, calls, type(failure))
        replayed = replay(target, shorter).failure
    if type(replayed) is not type(failure):
        return failure, calls
    return replayed, shorter


def run(
    factory: AllocatorFactory,
    config: MachineConfig = MachineConfig(),
    *,
    examples: int = 100,
    steps: int = 50,
    seed: Optional[int] = None,
    allocator_name: str = DEFAULT_ALLOCATOR,
    shrink: bool = True,
    database: Optional[ExampleDatabase] = None,
    derandomize: Optional[bool] = None,
    random_examples: Optional[int] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> RunSummary:
    """Run the machine against ``factory``; never raises for a failure the machine finds.

    The first ``random_examples`` (default: half of ``examples``) are plain random programs
    (:mod:`kvfuzz.program.random_programs`); the rest are Hypothesis's. With a ``database``, failing examples
    are saved there and tried first by the next run against the same allocator and configuration: such a run is
    Hypothesis's alone (no random programs unless ``random_examples`` says so) and random (Hypothesis ignores a
    database in derandomized or seeded runs). Otherwise runs are derandomized unless a ``seed`` is given or
    ``derandomize`` is false.
    """
    if database is not None:
        if seed is not None:
            raise ValueError(
                "a seed and an example database cannot be combined: Hypothesis ignores the database "
                "when the seed is fixed"
            )
        derandomize = False  # Hypothesis does not combine derandomize with a database
    elif derandomize is None:
        derandomize = seed is None
    if random_examples is None:
        random_examples = 0 if database is not None else examples // 2
    stats = RunStats(on_step=Progress(progress) if progress is not None else None)
    machine = machine_for(factory, config, stats)
    failure: Optional[BaseException] = None
    report: list[str] = []
    with single_threaded_torch():
        found = random_search(
            Target(factory, config, stats),
            examples=random_examples,
            steps=steps,
            seed=(0 if derandomize else None) if seed is None else seed,
        )
        if found is not None:
            failure = found.failure
        elif examples > random_examples:
            test = get_state_machine_test(
                machine,
                settings=run_settings(
                    examples - random_examples, steps, derandomize=derandomize, shrink=shrink, database=database
                ),
            )
            if seed is not None:
                test = hypothesis_seed(seed)(test)
            with with_reporter(lambda value: report.append(str(value))):
                try:
                    test()
                except Exception as error:  # noqa: BLE001 -- whatever the allocator raised is the finding
                    failure = error
    seconds = time.perf_counter() - stats.started
    summary = RunSummary(
        allocator_name,
        stats.examples,
        stats.steps,
        seconds,
        failure is not None,
        dict(sorted(stats.operations.items())),
        first_failure_examples=stats.first_failure_examples,
        first_failure_seconds=stats.first_failure_seconds,
        shrunk=shrink,
        occupancy=stats.occupancy.summary(),
    )
    if failure is None:
        return summary
    calls = list(found.calls) if found is not None else stats.last_failing_program or []
    if isinstance(failure, Exception) and shrink and calls:
        failure, calls = _shrink_further(Target(factory, config), calls, failure)
    if calls:
        program = program_text(machine.__name__, calls)
    else:
        notes = [*report, *getattr(failure, "__notes__", ())]
        program = "\n".join(
            line
            for note in notes
            for line in note.splitlines()
            if line.strip() and not line.startswith(("Falsifying", "Failing test case"))
        )
    summary = attrs.evolve(summary, program=program, calls=tuple(calls), failure=failure)
    if isinstance(failure, InvariantViolation):
        return attrs.evolve(
            summary, invariant=str(failure.invariant), violated=failure.invariant, explanation=failure.explain()
        )
    crash = "".join(traceback.format_exception(type(failure), failure, failure.__traceback__, limit=-4))
    return attrs.evolve(
        summary,
        invariant=f"crash ({type(failure).__name__})",
        explanation=f"the allocator (or kvfuzz) raised an unexpected exception:\n{crash}",
    )
