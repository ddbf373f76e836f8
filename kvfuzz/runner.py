"""Running the machine against an allocator and summarising what happened, for the CLI, the plugin and scripts.

A run is random programs over the operation table, then a Hypothesis search under explicit settings. Its summary
counts every operation exercised and, on failure, holds the shrunk program, kvfuzz's explanation of the broken
invariant, and how often replays of that program reproduced it.

No failure is lost: Ctrl-C ends the run with the best failure found so far (shrunk as far as it got); a call that
never returns is reported as a hang in the named operation; a ``BaseException`` from the allocator is its crash;
and the program being run is journalled before each call, so a process the allocator kills leaves it behind.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import random
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import attrs
from hypothesis.database import ExampleDatabase

from kvfuzz.accounting.occupancy import OccupancySummary
from kvfuzz.engine.config import MachineConfig, config_json
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.hypothesis_search import search_machine
from kvfuzz.profiles import run_settings
from kvfuzz.program.call import Call, program_text
from kvfuzz.program.execution import Safeguards, Target
from kvfuzz.program.failures import Broken, FailureKind, failure_kind
from kvfuzz.program.operations import OPERATIONS
from kvfuzz.program.random_programs import random_search
from kvfuzz.program.replay import NotApplicable, replay
from kvfuzz.program.safeguards import (
    DEFAULT_CALL_TIMEOUT,
    HANG_FACTOR,
    HANG_FLOOR,
    AllocatorHang,
    Journal,
    UserInterrupt,
    Watchdog,
    exits_as_crashes,
    user_interrupts,
)
from kvfuzz.program.stats import RunStats
from kvfuzz.program.swarm import draw_swarm, small_pools
from kvfuzz.registry import DEFAULT_ALLOCATOR, AllocatorFactory, AllocatorNotFound, builds, load_factory
from kvfuzz.shrink.fixpoint import HUNG_REPLAYS
from kvfuzz.shrink.fixpoint import shrink as shrink_to_fixpoint
from kvfuzz.shrink.restarts import Failing, Restarts
from kvfuzz.shrink.signature import signature_of
from kvfuzz.statemachines.machine import machine_for
from kvfuzz.text import plural
from kvfuzz.threads import single_threaded_torch

# load_factory and AllocatorNotFound lived here before kvfuzz.registry; exported tests import them from here.
__all__ = ["DEFAULT_ALLOCATOR", "AllocatorNotFound", "RunSummary", "load_factory", "run", "run_settings"]


CONFIRM_REPLAYS = 5
"""How many times a shrunk failure is replayed before it is reported: a failure that does not reproduce every time
is reported as flaky, with the count."""

CONFIRM_HANG_REPLAYS = 2
"""At most this many confirming replays of a hang: each that hangs again costs the watchdog's limit."""

SHRINK_SECONDS = 10.0
"""The time bound of kvfuzz's own shrinking, after Hypothesis's (a hang's shrink may also spend the watchdog's limit
on the replays that hang again: :data:`kvfuzz.shrink.fixpoint.HUNG_REPLAYS`)."""


@attrs.frozen
class RunSummary:
    """What one run did, and on failure the shrunk program and why it fails.

    ``kind`` is what failed, the one record of it (``invariant`` prints it, ``violated`` is its invariant when it
    broke one). ``examples`` counts the programs of the search (random programs and Hypothesis's examples), not the
    replays of shrinking and confirmation. ``declared_window`` is the in-flight window W the allocator declared
    (None: no program ran); the configuration's ``inflight_window`` is the W the run asked of its factory.
    ``first_failure_examples`` and ``first_failure_seconds`` say when the first failing example was met, before any
    shrinking. ``reproduced`` of ``replays`` says how often the reported program failed the same way when replayed
    on fresh allocators (fewer than all: flaky). ``interrupted`` says the user stopped the run; ``shrink_note`` says
    why the program was not shrunk further, when it was not. ``swarms`` counts the distinct operation subsets the
    random programs were drawn over (:mod:`kvfuzz.program.swarm`); ``pool`` is the configuration the failure was met
    in, shrunk and confirmed in, when the run's swarm drew it a smaller pool than the run's own (None: the run's).
    """

    allocator: str
    examples: int
    steps: int
    seconds: float
    failed: bool
    operations: dict[str, int]
    kind: Optional[FailureKind] = None  # what failed: an invariant broken, a crash or a hang (None: nothing)
    program: Optional[str] = None
    explanation: Optional[str] = None
    first_failure_examples: Optional[int] = None
    first_failure_seconds: Optional[float] = None
    shrunk: bool = True
    interrupted: bool = False
    shrink_note: Optional[str] = None
    reproduced: Optional[int] = None
    replays: int = 0
    examples_asked: Optional[int] = None
    declared_window: Optional[int] = None
    swarms: int = 0  # the distinct operation subsets the random programs were drawn over
    pool: Optional[MachineConfig] = attrs.field(default=None, repr=False)  # the failure's, where not the run's
    occupancy: Optional[OccupancySummary] = attrs.field(default=None, repr=False)
    calls: tuple[Call, ...] = attrs.field(default=(), repr=False)
    failure: Optional[BaseException] = attrs.field(default=None, repr=False)

    @property
    def invariant(self) -> Optional[str]:
        """The failure as printed: "invariant 5 (exclusive writes)", "crash (KeyError)", "hang" (None: none)."""
        return None if self.kind is None else str(self.kind)

    @property
    def violated(self) -> Optional[Invariant]:
        """The invariant broken, when the failure is one (None for a crash or a hang)."""
        return self.kind.invariant if isinstance(self.kind, Broken) else None

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0

    @property
    def flaky(self) -> bool:
        """The reported program did not fail the same way on every replay."""
        return self.failed and self.replays > 0 and self.reproduced != self.replays

    @property
    def program_length(self) -> int:
        """Operations in the failing program, shrunk unless ``shrunk`` is false (constructor and teardown not
        counted)."""
        return sum(
            1
            for line in (self.program or "").splitlines()
            if line.startswith("state.") and not line.startswith("state.teardown")
        )

    def to_json(self) -> dict[str, Any]:
        left_out = ("calls", "failure", "occupancy", "pool")
        fields = attrs.asdict(self, filter=lambda attribute, _: attribute.name not in left_out)
        fields = {
            ("invariant" if name == "kind" else name): (self.invariant if name == "kind" else value)
            for name, value in fields.items()
        }
        return {
            **fields,
            "flaky": self.flaky,
            "steps_per_second": round(self.steps_per_second, 1),
            "program_length": self.program_length,
            "occupancy": self.occupancy.to_json() if self.occupancy is not None else None,
            "pool": None if self.pool is None else pool_json(self.pool),
        }

    def describe_pool(self) -> Optional[str]:
        """For a person: the pool the failure was met in, when the run's swarm drew it (None: the run's own)."""
        if self.pool is None:
            return None
        pool = self.pool
        return (
            f"met in a pool the run's swarm drew: {plural(pool.num_blocks, 'block')} x "
            f"{plural(pool.block_size, 'slot')}, {plural(pool.num_host_blocks, 'host block')} (shrunk, confirmed and "
            "saved in it)"
        )


def pool_json(config: MachineConfig) -> dict[str, int]:
    """A pool's geometry, as a run's JSON object gives the pool its failure was met in."""
    return {"block_size": config.block_size, "num_blocks": config.num_blocks, "num_host_blocks": config.num_host_blocks}


@attrs.frozen
class HangFound:
    """A hang the search met, before it is shrunk: the run as it stands (``summary``, the program as found), and
    what shrinking and confirming it may cost. ``candidate_limit`` is how long a shrinking candidate's operation may
    run before it counts as hanging (None: the hang is not shrunk); ``shrink_seconds`` and ``confirm_seconds`` bound
    the two phases (a candidate that runs slow without hanging can stretch the first a little)."""

    summary: RunSummary
    candidate_limit: Optional[float]
    shrink_seconds: float
    confirm_seconds: float
    call_timeout: float

    def describe(self) -> str:
        """For a person: what follows the hang, and how long it may take."""
        confirming = (
            f"confirming it up to {self.confirm_seconds:.0f} s (replays at --call-timeout {self.call_timeout:g} s)"
        )
        if self.candidate_limit is None:
            return confirming
        return (
            f"shrinking it may take up to {self.shrink_seconds:.0f} s (a candidate is taken to hang after "
            f"{self.candidate_limit:.3g} s: {HANG_FACTOR:g} times the slowest call seen, at least {HANG_FLOOR:g} s), "
            + confirming
        )


class Progress:
    """Prints a progress line at most every ``interval`` seconds: the phase, examples of those asked, steps."""

    def __init__(self, write: Callable[[str], None], examples: int, interval: float = 1.0) -> None:
        self.write, self.examples, self.interval = write, examples, interval
        self.last = time.perf_counter()

    def __call__(self, stats: RunStats) -> None:
        now = time.perf_counter()
        if now - self.last >= self.interval:
            self.last = now
            where = (
                f"{stats.shrink_runs} replays"
                if stats.phase == "shrinking"
                else f"example {stats.examples} of {self.examples}"
            )
            self.write(
                f"  {stats.phase}: {where}, {stats.steps} steps, {stats.steps / (now - stats.started):.0f} steps/s"
            )


def _shrink_further(
    target: Target, allocator: str, calls: list[Call], failure: BaseException, steps: int, seed: int
) -> tuple[BaseException, list[Call], Optional[str]]:
    """Shrink the program with the campaign's shrinker (:func:`kvfuzz.shrink.fixpoint.shrink`, restarts included:
    a fixpoint still long is shrunk again from other failing random programs of up to ``steps`` calls over the
    operation table, drawn from a stream of ``seed`` and the signature) in the run's configuration, within
    :data:`SHRINK_SECONDS`: a candidate is kept only when it fails with the signature the program's own replay
    has (the same broken invariant or crash at the same operation; a hang in the same operation). The program as
    it was if its replay fails otherwise (a nondeterministic allocator); with why it was not shrunk further, if it
    was not, and the failures of other signatures its restarts met, which a run does not report (a campaign
    does). A hang is replayed and shrunk under the watchdog's :meth:`~kvfuzz.program.safeguards.Watchdog.hang_limit`,
    not its full limit: a candidate that hangs costs that much."""
    watchdog = target.safeguards.watchdog
    if not isinstance(failure, AllocatorHang) or watchdog is None:
        return _shrink_under(target, allocator, calls, failure, steps, seed)
    with watchdog.limited(watchdog.hang_limit(), "the shrink's limit: calls seen took far less"):
        return _shrink_under(target, allocator, calls, failure, steps, seed)


def _shrink_under(
    target: Target, allocator: str, calls: list[Call], failure: BaseException, steps: int, seed: int
) -> tuple[BaseException, list[Call], Optional[str]]:
    """:func:`_shrink_further` under the watchdog's limit as it is."""
    try:
        outcome = replay(target, calls)
    except NotApplicable:
        return failure, calls, "not shrunk further: the program did not replay (the allocator answered differently)"
    if outcome.failure is None or failure_kind(outcome.failure) != failure_kind(failure):
        return failure, calls, "not shrunk further: its replay did not fail the same way"
    signature = signature_of(allocator, outcome.failure, calls, outcome.failed_at, outcome.diverged)
    digest = hashlib.sha256(f"{seed} {signature.key()}".encode()).digest()
    shrunk = shrink_to_fixpoint(
        target.factory,
        target.config,
        calls,
        outcome.failure,
        signature,
        seconds=SHRINK_SECONDS,
        safeguards=target.safeguards,
        stats=target.stats,
        restarts=Restarts(OPERATIONS, steps, random.Random(int.from_bytes(digest[:8], "little"))),
    )
    notes = [note for note in (shrunk.stopped_early, _others_met(shrunk.others)) if note is not None]
    return shrunk.failure, list(shrunk.calls), "; ".join(notes) or None


def _hang_found(as_found: RunSummary, watchdog: Watchdog, shrink: bool, replays: int) -> HangFound:
    """What follows the hang ``as_found`` reports: its shrink under the watchdog's hang limit (the program's own
    replay, :data:`SHRINK_SECONDS`, and :data:`~kvfuzz.shrink.fixpoint.HUNG_REPLAYS` candidates that hang), and
    its confirming replays at the watchdog's full limit."""
    limit = watchdog.hang_limit() if shrink else None
    shrinking = 0.0 if limit is None else SHRINK_SECONDS + (HUNG_REPLAYS + 1) * limit
    return HangFound(as_found, limit, shrinking, replays * watchdog.seconds, watchdog.seconds)


def _others_met(others: tuple[Failing, ...]) -> Optional[str]:
    """A note naming the failures of other signatures that shrinking met (None: none): a run reports one failure,
    so the others are named for the user to look into, after this one (a campaign shrinks and saves each)."""
    if not others:
        return None
    return "shrinking also met " + "; ".join(str(other.signature) for other in others) + " (run a campaign for each)"


def confirm(target: Target, calls: list[Call], failure: BaseException, replays: int) -> int:
    """How many of ``replays`` replays of ``calls`` on fresh allocators fail the way ``failure`` did."""
    kind = failure_kind(failure)
    reproduced = 0
    for _ in range(replays):
        try:
            outcome = replay(target, calls).failure
        except NotApplicable:  # the allocator answered differently, so the program took another path
            continue
        reproduced += outcome is not None and failure_kind(outcome) == kind
    return reproduced


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
    call_timeout: Optional[float] = DEFAULT_CALL_TIMEOUT,
    journal_dir: Optional[Path] = None,
    confirm_replays: int = CONFIRM_REPLAYS,
    database_key: Optional[bytes] = None,
    on_hang: Optional[Callable[[HangFound], None]] = None,
) -> RunSummary:
    """Run the machine against ``factory``; never raises for a failure the machine finds, nor for Ctrl-C.

    The first ``random_examples`` (default: three quarters of ``examples``) are random programs
    (:mod:`kvfuzz.program.random_programs`), every third over a weighted subset of the operations that a swarm draws
    (:func:`~kvfuzz.program.swarm.draw_swarm`), the others over the whole table, so that the whole table's get as
    many programs as when they had half of ``examples`` to themselves; the rest are Hypothesis's, which switches
    rules off per example. With a ``database``, failing examples are
    saved there and tried first by the next run against the same allocator and configuration: such a run is
    Hypothesis's alone (no random programs unless ``random_examples`` says so) and random (Hypothesis ignores a
    database in derandomized or seeded runs). Otherwise runs are derandomized unless a ``seed`` is given or
    ``derandomize`` is false. ``call_timeout`` bounds each operation (None: no watchdog); ``journal_dir`` keeps the
    running program in a journal there (see :class:`~kvfuzz.program.safeguards.Journal`). ``database_key``
    replaces the part of the example database's key that Hypothesis derives from the machine class (whose name is
    the factory's), so that runs of one allocator under different configurations keep their examples apart (a
    saved example that does not fail when replayed is deleted).

    ``on_hang`` is told of a hang as soon as the search meets it, before it is shrunk (each candidate that hangs
    costs time: the caller saves it at once, and says how long the rest may take). A hang is shrunk under a limit
    from the calls' observed times (:meth:`~kvfuzz.program.safeguards.Watchdog.hang_limit`) and confirmed at
    ``call_timeout``: the hang reported is one past the full limit.
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
        random_examples = 0 if database is not None else examples * 3 // 4
    random_examples = min(random_examples, examples)
    stats = RunStats(on_step=Progress(progress, examples) if progress is not None else None)
    journal: Optional[Journal] = None
    if journal_dir is not None:
        with contextlib.suppress(OSError):  # no journal is better than no run: the run still reports what it finds
            journal = Journal(
                journal_dir, {"allocator": allocator_name}, {"config": config_json(config, config.inflight_window)}
            )
    failure: Optional[BaseException] = None
    calls: list[Call] = []
    pool: Optional[MachineConfig] = None  # the failure's pool, where the swarm drew it
    interrupted = shrunk = False
    shrink_note: Optional[str] = None
    report: list[str] = []
    counted: Optional[int] = None  # the examples Hypothesis's search phases ran (None: no Hypothesis search)
    watchdog = Watchdog(call_timeout) if call_timeout is not None else None
    try:
        with single_threaded_torch(), user_interrupts(), exits_as_crashes(), watchdog or contextlib.nullcontext():
            target = Target(factory, config, stats, Safeguards(journal, watchdog))
            try:
                pools = (
                    small_pools(config, lambda pool: builds(allocator_name, factory, pool.pool_spec()))
                    if random_examples
                    else ()
                )
                found = random_search(
                    target,
                    examples=random_examples,
                    steps=steps,
                    seed=(0 if derandomize else None) if seed is None else seed,
                    swarm=functools.partial(draw_swarm, pools=pools),
                )
                if found is not None:
                    failure, calls = found.failure, list(found.calls)
                    if found.config is not None:  # met in a pool the swarm drew: shrunk and confirmed there
                        pool, target = found.config, attrs.evolve(target, config=found.config)
                elif examples > random_examples:
                    stats.phase = "Hypothesis search"
                    # A derandomized run is seeded explicitly rather than by Hypothesis's derandomize, whose seed is a
                    # digest of the test that came out different under pytest than from the command line.
                    searched = search_machine(
                        machine_for(factory, config, stats, target.safeguards),
                        run_settings(
                            examples - random_examples, steps, derandomize=False, shrink=shrink, database=database
                        ),
                        seed=0 if seed is None and derandomize else seed,
                        database_key=database_key,
                    )
                    counted = searched.examples
                    report = list(searched.report)
                    failure = searched.failure
                    calls = list(stats.last_failing_program or []) if failure is not None else []
                    flaky = searched.flaky is not None and not isinstance(failure, AllocatorHang)
                    if flaky and stats.best_program is not None:  # its replay went differently: the shortest met
                        failure, calls = stats.best_failure or failure, list(stats.best_program)
                    elif failure is None and searched.error is not None:  # Hypothesis's own error: never a finding
                        raise searched.error
            except AllocatorHang as hang:
                if stats.best_failure is not None and not isinstance(stats.best_failure, AllocatorHang):
                    failure, calls = stats.best_failure, list(stats.best_program or [])
                    shrink_note = f"Hypothesis's shrinking stopped when a candidate program hung ({hang})"
                else:
                    failure, calls = hang, list(stats.last_failing_program or [])
            except UserInterrupt:
                interrupted = True
                failure = None
            if isinstance(failure, AllocatorHang) and calls and on_hang is not None and watchdog is not None:
                as_found = _summary(allocator_name, stats, counted, random_examples, examples, shrunk=False, pool=pool)
                as_found = _failed(as_found, failure, calls, factory, target.config, report)
                try:
                    on_hang(_hang_found(as_found, watchdog, shrink, min(confirm_replays, CONFIRM_HANG_REPLAYS)))
                except UserInterrupt:
                    interrupted = True
            if failure is not None and shrink and calls and not interrupted:
                stats.phase = "shrinking"
                try:
                    failure, calls, note = _shrink_further(
                        target, allocator_name, calls, failure, steps, 0 if seed is None else seed
                    )
                    shrunk = True
                    shrink_note = note if shrink_note is None or note is None else f"{shrink_note}; {note}"
                except UserInterrupt:
                    interrupted = True
            if interrupted and stats.best_failure is not None:
                failure, calls = stats.best_failure, list(stats.best_program or [])
                shrink_note = "interrupted: shrunk only as far as it got"
            reproduced: Optional[int] = None
            replays = 0
            if failure is not None and calls and not interrupted:
                replays = (
                    min(confirm_replays, CONFIRM_HANG_REPLAYS)
                    if isinstance(failure, AllocatorHang)
                    else confirm_replays
                )
                stats.phase = "confirming"
                try:
                    reproduced = confirm(
                        Target(factory, target.config, None, target.safeguards), calls, failure, replays
                    )
                except UserInterrupt:
                    interrupted, replays, reproduced = True, 0, None
                if isinstance(failure, AllocatorHang) and reproduced and watchdog is not None:
                    failure = AllocatorHang(failure.operation, watchdog.seconds)  # shrunk under a shorter limit
    finally:
        if journal is not None:
            journal.close()
    summary = _summary(
        allocator_name,
        stats,
        counted,
        random_examples,
        examples,
        shrunk=shrunk,
        interrupted=interrupted,
        shrink_note=shrink_note,
        reproduced=reproduced,
        replays=replays,
        pool=pool if failure is not None else None,
    )
    return summary if failure is None else _failed(summary, failure, calls, factory, pool or config, report)


def _summary(
    allocator_name: str,
    stats: RunStats,
    counted: Optional[int],
    random_examples: int,
    examples: int,
    **fields: Any,
) -> RunSummary:
    """The run as it stands: its counts and ``fields`` (how far its failure got), without the failure."""
    seconds = time.perf_counter() - stats.started
    searched = stats.examples if counted is None else min(stats.examples, random_examples) + counted
    return RunSummary(
        allocator_name,
        searched,
        stats.steps,
        seconds,
        False,
        dict(sorted(stats.operations.items())),
        first_failure_examples=stats.first_failure_examples,
        first_failure_seconds=stats.first_failure_seconds,
        examples_asked=examples,
        declared_window=stats.declared_window,
        swarms=len(stats.swarms),
        occupancy=stats.occupancy.summary(),
        **fields,
    )


def _failed(
    summary: RunSummary,
    failure: BaseException,
    calls: list[Call],
    factory: AllocatorFactory,
    config: MachineConfig,
    report: list[str],
) -> RunSummary:
    """``summary`` with ``failure``, met by ``calls`` (none: Hypothesis's ``report`` holds what it printed of the
    program): its kind, its program and its explanation."""
    if calls:
        program = program_text(machine_for(factory, config).__name__, calls)
    else:
        notes = [*report, *getattr(failure, "__notes__", ())]
        program = "\n".join(
            line
            for note in notes
            for line in note.splitlines()
            if line.strip() and not line.startswith(("Falsifying", "Failing test case"))
        )
    summary = attrs.evolve(
        summary, failed=True, kind=failure_kind(failure), program=program, calls=tuple(calls), failure=failure
    )
    if isinstance(failure, InvariantViolation):
        return attrs.evolve(summary, explanation=failure.explain())
    if isinstance(failure, AllocatorHang):
        explanation = f"the allocator hung: {failure}\nthe program up to the call that hung is above"
        return attrs.evolve(summary, explanation=explanation)
    shown = getattr(failure, "original", failure)
    crash = "".join(traceback.format_exception(type(shown), shown, shown.__traceback__, limit=-4))
    return attrs.evolve(summary, explanation=f"the allocator (or kvfuzz) raised an unexpected exception:\n{crash}")
