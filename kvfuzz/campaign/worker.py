"""The search of one worker of an allocator campaign (its process: :mod:`kvfuzz.campaign.process`): search under
swarmed configurations until told to stop, and shrink and save every failure whose signature it is the first to
claim.

A worker alternates batches of plain random programs over a drawn :class:`~kvfuzz.campaign.swarm.SwarmConfig` with
short Hypothesis rounds on the campaign's shared example database (whose saved failures Hypothesis replays first).
With ``--coverage`` it measures its allocators' code per example (:mod:`kvfuzz.campaign.feedback`); with ``--guided``
it also keeps each random program that reached new code as a seed, and once there are seeds up to half its batches
(the share mutants earn) run mutants of one (:mod:`kvfuzz.program.mutants`), and the configuration of the others is
one the bandit gives more batches for still finding, or a fresh draw. A mutant's failure is a failure like any:
claimed, shrunk, saved.
Its seed stream is its own: ``plan.seed`` differs for every worker slot and every replacement. The program it runs
is journalled before each call (:class:`~kvfuzz.program.safeguards.Journal`), so if the allocator kills the
process the campaign recovers that program from the journal.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import random
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import attrs
from hypothesis.database import ExampleDatabase

from kvfuzz.allocator.types import PoolSpec
from kvfuzz.campaign.claims import WorkerClaims
from kvfuzz.campaign.cluster import is_redis
from kvfuzz.campaign.feedback import Feedback, FeedbackJournal
from kvfuzz.campaign.messages import Batch, Saved
from kvfuzz.campaign.protocol import WorkerContext
from kvfuzz.campaign.seeds import SEED_DIRECTORY, Seed, SeedPool
from kvfuzz.campaign.store import open_examples
from kvfuzz.campaign.swarm import OPERATIONS_ROW, Limits, SwarmConfig, draw_swarm, swarm_of, swarm_values
from kvfuzz.coverage.scope import Scope, allocator_scope
from kvfuzz.engine.config import MachineConfig, config_json
from kvfuzz.engine.violations import InvariantViolation
from kvfuzz.program.call import Call, program_text
from kvfuzz.program.execution import Safeguards, Target
from kvfuzz.program.mutants import mutate, run_mutant
from kvfuzz.program.operations import OPERATIONS
from kvfuzz.program.random_programs import RandomFailure, random_program
from kvfuzz.program.replay import Divergence, NotApplicable, replay
from kvfuzz.program.safeguards import DEFAULT_CALL_TIMEOUT, AllocatorHang, Journal, Watchdog
from kvfuzz.program.stats import RunStats
from kvfuzz.registry import AllocatorFactory, builds, load_factory
from kvfuzz.runner import CONFIRM_HANG_REPLAYS, run
from kvfuzz.saved.trace import Trace, TraceError, failure_record, program_from_json, save
from kvfuzz.shrink.candidates import Pools
from kvfuzz.shrink.fixpoint import shrink
from kvfuzz.shrink.restarts import Failing, Restarts
from kvfuzz.shrink.signature import Signature, signature_of
from kvfuzz.statemachines.machine import machine_for
from kvfuzz.swarm_table import Pins

CONFIRM_REPLAYS = 3
"""Replays of a shrunk program on fresh allocators before it is reported: fewer failing than all is flaky."""

BATCH = 20
"""Random programs run under one swarm configuration, at most."""

BATCH_STEPS = 1500
"""A batch also ends once its programs have made this many calls (long programs), so that a campaign of a few
seconds still tries several configurations; counted in the programs' own calls, not in seconds nor with the replays
that shrink a failure (their number depends on the shrink's time bound and on what other workers claimed first), so
that a worker's search is the same under the same seed on a busy machine."""

HYPOTHESIS_EVERY = 4
"""One batch in this many is a Hypothesis round on the shared example database (the second batch, then every
fourth), so that the failures saved there by other workers are replayed early."""

HYPOTHESIS_STEPS = 100
"""The longest program of a Hypothesis round."""

UNHELD_BY_HYPOTHESIS = ("operations", "program_length")
"""Swarm rows a Hypothesis round does not hold (its machine draws from the whole operation table, programs of at most
:data:`HYPOTHESIS_STEPS` calls): a campaign that pins one runs random batches alone, so that the pin holds in every
batch."""

HYPOTHESIS_EXAMPLES = 20
"""Examples of one Hypothesis round."""


@attrs.frozen
class WorkerPlan:
    """Everything an allocator campaign's worker needs, fixed when it starts."""

    slot: int  # the worker's slot, 0 .. workers - 1
    seed: int  # its own seed stream (differs per slot and per replacement)
    allocators: tuple[str, ...]  # the campaign's allocator specs
    limits: tuple[Limits, ...]  # what each builds, in the same order
    base: MachineConfig  # model shape and kernel; the geometry is swarmed
    corpus: Path  # where traces and the journal go
    database: Optional[str]  # redis://... or an example-database directory; None: the local default
    state: Path  # the campaign's local state: example database and, without Redis, the signature store
    call_timeout: Optional[float] = DEFAULT_CALL_TIMEOUT  # the watchdog's limit per operation
    shrink_seconds: float = 30.0  # the time bound of one shrink
    hypothesis_every: int = HYPOTHESIS_EVERY  # 0: no Hypothesis rounds
    campaign_seed: Optional[int] = None  # the campaign's --seed, recorded with each finding stored in Redis
    pins: Pins = ()  # swarm rows held at one value (--pin)
    coverage: bool = False  # measure the allocators' code (--coverage): each batch's new points sent to the campaign
    guided: bool = False  # and use it (--guided): seeds, mutants, a bandit over configurations


SEEDS = "allocator"
"""The seed pool's target name for allocator campaigns (a seed's configuration names its allocator)."""


@attrs.frozen
class Mutants:
    """A batch of mutants: the configuration of their seed, its calls, and those of another seed of the same
    configuration (what a splice takes its tail from)."""

    swarm: SwarmConfig
    digest: str  # the seed's
    program: tuple[Call, ...]
    other: tuple[Call, ...]


def _feedback(plan: WorkerPlan, factories: Iterable[AllocatorFactory]) -> Optional[Feedback[SwarmConfig]]:
    """The worker's coverage of its allocators' code (every allocator of the campaign together: their
    :func:`~kvfuzz.coverage.scope.allocator_scope`), with the seed pool when guided; None without ``--coverage``."""
    if not plan.coverage:
        return None
    roots = {root for factory in factories for root in allocator_scope(factory).roots}
    shared = plan.database if is_redis(plan.database) else None
    pool = SeedPool(plan.state / SEED_DIRECTORY, SEEDS, shared) if plan.guided else None
    return Feedback(Scope(tuple(sorted(roots))), plan.slot, pool)


class _Worker:
    """The search loop of one worker and what it does with each failure."""

    def __init__(self, plan: WorkerPlan, worker: WorkerContext) -> None:
        self.plan = plan
        self.worker = worker
        self.reporter = worker.reporter
        self.stop = worker.stop  # set by the campaign when it ends
        self.halt = worker.halt  # set on Ctrl-C: shrinks end early too
        # The random batches draw from self.rng alone, so they repeat under the same seed. The global random is
        # seeded too, but Hypothesis rounds do not repeat: Hypothesis seeds its search itself, and a seeded search
        # would ignore the shared example database (docs/campaigns.md: what a rerun repeats).
        random.seed(plan.seed)
        self.rng = random.Random(plan.seed)
        self.factories: dict[str, AllocatorFactory] = {spec: load_factory(spec) for spec in plan.allocators}
        self.limits = dict(zip(plan.allocators, plan.limits))
        self.claims = WorkerClaims(worker, plan.database, plan.campaign_seed)
        self.examples_db: Optional[ExampleDatabase] = None  # opened on the first Hypothesis round
        self.stats = RunStats(on_step=self.reporter.on_step)
        self.built: dict[tuple[str, PoolSpec], bool] = {}  # whether each factory builds each pool drawn so far
        # with --coverage: the code under test of every allocator of the campaign, measured per example
        self.feedback = _feedback(plan, self.factories.values())
        self.batch_examples = 0  # the running batch's examples
        self.batch_calls = 0  # and their calls (its own programs', not the replays of its shrinks)

    def search(self) -> None:
        number = 0  # batches other than mutants': one in hypothesis_every is a Hypothesis round
        feedback = self.feedback
        try:
            while not self.stop.is_set():
                mutants = self.mutants() if feedback is not None and feedback.mutating(self.rng) else None
                if mutants is not None:
                    self.logged(mutants.swarm, "mutants", functools.partial(self.mutant_batch, mutants), mutants.digest)
                    continue
                arm = feedback.arm(self.rng) if feedback is not None else None
                swarm = arm if arm is not None else self.draw()
                if not self.builds(swarm):
                    continue  # a pool the factory refuses (one its sectors cannot fill, say): draw another
                number += 1
                every = self.hypothesis_every()
                if every and number % every == 2 % every:
                    self.logged(swarm, "hypothesis", functools.partial(self.hypothesis_round, swarm), fresh=arm is None)
                else:
                    self.logged(swarm, "random", functools.partial(self.random_batch, swarm), fresh=arm is None)
        finally:
            if feedback is not None:
                feedback.stop()

    def logged(
        self,
        swarm: SwarmConfig,
        kind: str,
        body: Callable[[], None],
        mutated: Optional[str] = None,
        fresh: bool = False,
    ) -> None:
        """Run one batch (``body``) and tell the campaign of it: its entry in the batch log (its configuration, its
        kind, the examples and calls it ran) and, with coverage, what it reached first."""
        values = swarm_values(swarm)
        if self.feedback is not None:
            self.feedback.begin(swarm, values, mutated=mutated, drawn_fresh=fresh)
        self.batch_examples = self.batch_calls = 0
        body()
        entry = {**values, "batch": kind, "examples": self.batch_examples, "steps": self.batch_calls}
        if self.feedback is not None:
            self.reporter.send(self.feedback.end())
            entry.update(self.feedback.entry())
        self.reporter.send(Batch(self.plan.slot, entry, 0))

    def hypothesis_every(self) -> int:
        """One batch in how many is a Hypothesis round (0: none, where a pin holds a row it does not)."""
        pinned = any(row in UNHELD_BY_HYPOTHESIS for row, _ in self.plan.pins)
        return 0 if pinned else self.plan.hypothesis_every

    def draw(self) -> SwarmConfig:
        """A fresh configuration: an allocator of the campaign, and its table's rows (the pinned ones held)."""
        spec = self.rng.choice(self.plan.allocators)
        return draw_swarm(self.rng, self.limits[spec], self.plan.base, dict(self.plan.pins))

    def mutants(self) -> Optional[Mutants]:
        """A seed to mutate, read back as a configuration of this campaign (one of its allocators, a pool it builds,
        its pins) and a program; None when the pool holds none that is (those that are not are dropped)."""
        assert self.feedback is not None
        chosen = self.feedback.seed_to_mutate(self.rng, self._read)
        if chosen is None:
            return None
        seed, (swarm, program), other = chosen
        try:
            spliced = program_from_json(list(other.program)) if other is not None else []
        except TraceError:
            spliced = []
        return Mutants(swarm, seed.digest, tuple(program), tuple(spliced))

    def _read(self, seed: Seed) -> tuple[SwarmConfig, list[Call]]:
        """The configuration and program of ``seed``, if this campaign runs them: ``KeyError`` or ``ValueError`` for
        another campaign's allocator, table, kvfuzz or pins (a seed of an earlier campaign on the corpus)."""
        swarm = swarm_of(seed.config, self.limits[str(seed.config.get("allocator"))], self.plan.base)
        values = {**swarm_values(swarm), OPERATIONS_ROW: swarm.operations}
        if any(values.get(row) != value for row, value in self.plan.pins) or not self.builds(swarm):
            raise ValueError("outside the campaign's pins or pools")
        return swarm, program_from_json(list(seed.program), f"seed {seed.digest}")  # TraceError: a ValueError

    def builds(self, swarm: SwarmConfig) -> bool:
        """Whether the swarm's factory builds its pool: the probe before the campaign asked only for each block size
        and for tiny pools, and a factory may refuse some counts of blocks in between."""
        pool = swarm.machine.pool_spec()
        key = (swarm.allocator, pool)
        if key not in self.built:
            self.built[key] = builds(swarm.allocator, self.factories[swarm.allocator], pool)
        return self.built[key]

    def _journal(self, swarm: SwarmConfig) -> Optional[Journal]:
        """The batch's journal, telling the feedback (with coverage) each example's start and calls."""
        try:
            return FeedbackJournal(
                self.plan.corpus,
                {"allocator": swarm.allocator},
                {"config": config_json(swarm.machine, swarm.machine.inflight_window)},
                self.feedback,
            )
        except OSError:
            return None  # no journal is better than no search: a crash then loses its program

    def random_batch(self, swarm: SwarmConfig) -> None:
        operations = swarm.operation_records()
        self.batch(swarm, lambda target: random_program(target, self.rng, swarm.program_length, operations))

    def mutant_batch(self, mutants: Mutants) -> None:
        operations = mutants.swarm.operation_records()

        def program(target: Target) -> Optional[RandomFailure]:
            return run_mutant(target, self.rng, mutate(mutants.program, self.rng, mutants.other), operations)

        self.batch(mutants.swarm, program)

    def batch(self, swarm: SwarmConfig, program: Callable[[Target], Optional[RandomFailure]]) -> None:
        """Up to :data:`BATCH` programs (random ones, or mutants) in ``swarm``, each failure claimed, shrunk and
        saved, until the batch's calls pass :data:`BATCH_STEPS`."""
        factory = self.factories[swarm.allocator]
        journal = self._journal(swarm)
        try:
            with Watchdog(self.plan.call_timeout) if self.plan.call_timeout else contextlib.nullcontext() as watchdog:
                safeguards = Safeguards(journal, watchdog)
                target = Target(factory, swarm.machine, self.stats, safeguards)
                made = 0  # calls of this batch's own programs (BATCH_STEPS), not of the shrinks of what they found
                for _ in range(BATCH):
                    if made >= BATCH_STEPS or self.stop.is_set() or not self.worker.take_examples(1):
                        return
                    self.reporter.example()
                    before = self.stats.steps
                    found = program(target)
                    made += self.stats.steps - before
                    self.batch_examples += 1
                    self.batch_calls += self.stats.steps - before
                    if found is not None:
                        with self.unseeded():
                            self.failure(swarm, list(found.calls), found.failure, safeguards)
        finally:
            if journal is not None:
                journal.close()

    def hypothesis_round(self, swarm: SwarmConfig) -> None:
        """A short Hypothesis search (no shrinking: kvfuzz shrinks what it claims) on the shared example database."""
        examples = self.worker.take_examples(HYPOTHESIS_EXAMPLES)
        if not examples:
            return
        if self.examples_db is None:
            self.examples_db = open_examples(self.plan.database, self.plan.state / "examples")
        # what the round runs: every operation of the table, programs of at most HYPOTHESIS_STEPS calls
        swarm = attrs.evolve(
            swarm,
            program_length=min(swarm.program_length, HYPOTHESIS_STEPS),
            operations=tuple(operation.name for operation in OPERATIONS),
        )
        summary = run(
            self.factories[swarm.allocator],
            swarm.machine,
            examples=examples,
            steps=swarm.program_length,
            allocator_name=swarm.allocator,
            shrink=False,
            database=self.examples_db,
            random_examples=0,
            progress=lambda line: self.reporter.flush(),
            call_timeout=self.plan.call_timeout,
            journal_dir=self.plan.corpus,
            confirm_replays=0,
            database_key=_database_key(swarm),
        )
        self.reporter.examples += summary.examples
        self.reporter.steps += summary.steps
        self.batch_examples, self.batch_calls = summary.examples, summary.steps
        if summary.failed and summary.calls and summary.failure is not None:
            journal = self._journal(swarm)  # its replays and shrinking are journalled like a random batch's
            try:
                watchdog = Watchdog(self.plan.call_timeout) if self.plan.call_timeout else None
                with watchdog or contextlib.nullcontext(), self.unseeded():
                    self.failure(swarm, list(summary.calls), summary.failure, Safeguards(journal, watchdog))
            finally:
                if journal is not None:
                    journal.close()

    def unseeded(self) -> contextlib.AbstractContextManager[None]:
        """With coverage: a failure's replays and shrinking count for the batch's coverage, never kept as seeds."""
        return self.feedback.unseeded() if self.feedback is not None else contextlib.nullcontext()

    def failure(self, swarm: SwarmConfig, calls: list[Call], failure: BaseException, safeguards: Safeguards) -> None:
        """A failing program: count it if its signature is known, else claim it, shrink it, confirm it and save it."""
        factory = self.factories[swarm.allocator]
        failed_at: Optional[int] = None
        diverged: Optional[Divergence] = None
        try:  # a hang's replay costs the watchdog's limit, and tells a hang in the teardown from one in the last call
            outcome = replay(Target(factory, swarm.machine, None, safeguards), calls)
        except NotApplicable:
            outcome = None
        if outcome is not None and outcome.failure is not None:
            failure, failed_at, diverged = outcome.failure, outcome.failed_at, outcome.diverged
        signature = signature_of(swarm.allocator, failure, calls, failed_at, diverged)
        if not self.claims.claim(signature, swarm.recorded(), len(calls)):
            return
        try:
            others = self.save(swarm, calls, failure, signature, safeguards)
        finally:
            self.reporter.phase = "searching"
        for other in others:  # met while shrinking: each counted, or claimed, shrunk and saved, like any failure
            if self.stop.is_set():
                break
            self.failure(attrs.evolve(swarm, machine=other.config), list(other.calls), other.failure, safeguards)

    def _restart_rng(self, signature: Signature) -> random.Random:
        """The random stream a shrink's restarts draw from: the worker's seed and the signature's, so that how far a
        time-bounded shrink got leaves the worker's own search stream (and what it finds next) unchanged."""
        digest = hashlib.sha256(f"{self.plan.seed} {signature.key()}".encode()).digest()
        return random.Random(int.from_bytes(digest[:8], "little"))

    def save(
        self,
        swarm: SwarmConfig,
        calls: list[Call],
        failure: BaseException,
        signature: Signature,
        safeguards: Safeguards,
    ) -> tuple[Failing, ...]:
        """Shrink, confirm and save one claimed failure; return the failures of other signatures its shrinking met."""
        factory = self.factories[swarm.allocator]
        limits = self.limits[swarm.allocator]
        config: MachineConfig = swarm.machine
        shrunk = shrink(
            factory,
            config,
            calls,
            failure,
            signature,
            seconds=self.plan.shrink_seconds,
            pools=Pools(limits.min_blocks, limits.block_sizes),
            safeguards=safeguards,
            stop=self.halt.is_set,
            stats=self.stats,
            restarts=Restarts(swarm.operation_records(), swarm.program_length, self._restart_rng(signature)),
        )
        config, calls, failure = shrunk.config, list(shrunk.calls), shrunk.failure
        note = self.claims.noted(signature, swarm.recorded(), shrunk.stopped_early)
        others = shrunk.others
        replays = min(CONFIRM_REPLAYS, CONFIRM_HANG_REPLAYS) if isinstance(failure, AllocatorHang) else CONFIRM_REPLAYS
        reproduced = _confirm(factory, config, calls, signature, safeguards, replays)
        trace = Trace(
            swarm.allocator,
            config,
            calls,
            _failure_record(failure, signature),
            # the W declared: the one asked for (the probe found the factory builds it), else the factory's own
            limits.declared_window if config.inflight_window is None else config.inflight_window,
            flaky=(reproduced, replays) if replays and reproduced != replays else None,
            swarm=swarm.to_json(),
        )
        try:
            path, _ = save(trace, self.plan.corpus)
            saved, unsaved = str(path), None
        except OSError:
            saved, unsaved = None, trace.to_json()
        shared = self.claims.share(trace, signature, saved)
        if shared is not None:  # a server gone away is said in the note: the local trace still stands
            note = shared.noted(note)
        self.reporter.send(
            Saved(
                self.plan.slot,
                signature.key(),
                len(calls),
                saved,
                note,
                reproduced,
                replays,
                program_text(machine_for(factory, config).__name__, calls),
                str(trace.failure.get("explanation", "")),
                unsaved,
            )
        )
        return others


def _database_key(swarm: SwarmConfig) -> bytes:
    """The example database's key for one allocator and pool: an example saved under another geometry would not
    fail here, and Hypothesis deletes a saved example that does not fail."""
    text = json.dumps([swarm.allocator, config_json(swarm.machine, None)], sort_keys=True)
    return hashlib.sha256(text.encode()).digest()


def _confirm(
    factory: AllocatorFactory,
    config: MachineConfig,
    calls: Sequence[Call],
    signature: Signature,
    safeguards: Safeguards,
    replays: int,
) -> int:
    """How many of ``replays`` replays on fresh allocators fail with ``signature``."""
    reproduced = 0
    for _ in range(replays):
        try:
            outcome = replay(Target(factory, config, None, safeguards), calls)
        except NotApplicable:
            continue
        if outcome.failure is not None:
            found = signature_of(signature.allocator, outcome.failure, calls, outcome.failed_at, outcome.diverged)
            reproduced += found == signature
    return reproduced


def _failure_record(failure: BaseException, signature: Signature) -> dict[str, Any]:
    if isinstance(failure, InvariantViolation):
        return failure_record(failure)
    if isinstance(failure, AllocatorHang):
        explanation = f"the allocator hung: {failure}"
    else:
        shown = getattr(failure, "original", failure)
        crash = "".join(traceback.format_exception(type(shown), shown, shown.__traceback__, limit=-4))
        explanation = f"the allocator (or kvfuzz) raised an unexpected exception:\n{crash}"
    return {"invariant": None, "title": signature.failure, "operation": signature.operation, "explanation": explanation}
