"""A guided scheduler campaign's search (``--guided``): what a scheduler target adds to the coverage feedback every
target shares (:mod:`kvfuzz.campaign.feedback`: each example's coverage, the seeds, the bandit).

* once the seed pool holds seeds, up to half the batches mutate them (as many as mutants earn:
  :data:`~kvfuzz.campaign.feedback.MUTATE_SHARE`) (:mod:`kvfuzz.scheduler.mutate`): each example of such a
  batch is a mutant of one seed (spliced with another of its configuration), run as a program (the trace replay's
  code, every check on); the other half are Hypothesis batches as before;
* the configuration of a Hypothesis batch is one that still finds new coverage, drawn by the bandit, or a fresh draw
  of the swarm table; a configuration the engine refused is remembered and refused at once if drawn again, without
  asking the engine. A fresh draw takes the values of each stratified row (``Dimension.stratified``: vLLM's model,
  whose kinds run different KV-cache managers) in turn, the one drawn least so far first, so that no kind waits on
  its weight's luck: a ten-minute campaign once drew the Mamba hybrid in none of its 47 batches. The KV connector's
  row is stratified too (a ten-minute campaign of 195 batches drew the P/D connector, which needs full attention, in
  none), and partial prefix hashing's (the block pool's partial entries); one row's value is held per draw.

A failure of a mutant is a finding like any: claimed by signature, saved as found, shrunk by deleting operations
under its signature (a mutant is no Hypothesis example for Hypothesis to shrink:
:mod:`kvfuzz.scheduler.shrinking`), and confirmed by a replay.

Invariant: the example boundaries are the journal's (the worker's :class:`~kvfuzz.campaign.feedback.FeedbackJournal`
begins each example and tells the feedback), so coverage is taken per example in Hypothesis batches and in mutant
batches alike; the points reached while an example's scheduler is built count for that example.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any, Callable, Mapping, Optional

import attrs

from kvfuzz.campaign.feedback import Feedback
from kvfuzz.campaign.scheduler.loop import (
    BatchPlan,
    BatchResult,
    IsNew,
    SchedulerCampaignOptions,
    by_deletion,
    confirmed,
    searching_until,
)
from kvfuzz.campaign.scheduler.target import SchedulerTarget
from kvfuzz.campaign.seeds import SEED_DIRECTORY, Seed, SeedPool
from kvfuzz.coverage.scope import Scope, engine_scope
from kvfuzz.program.safeguards import Journal
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.mutate import mutate
from kvfuzz.scheduler.program import Operation, Step, program_source
from kvfuzz.scheduler.recorder import save_scheduler_trace
from kvfuzz.scheduler.replay import ReplayRefused
from kvfuzz.scheduler.search import Outcome, SearchCutOff
from kvfuzz.scheduler.signature import scheduler_signature
from kvfuzz.scheduler.swarm import MODEL_RUNNER, NothingValid, SwarmConfig
from kvfuzz.scheduler.trace import (
    RecordedFailure,
    SchedulerTrace,
    SchedulerTraceError,
    journal_configuration,
    program_from_json,
)

RUNNING = RecordedFailure("crash", "(none: a program run for coverage)", "NoFailure")
"""The failure field of a mutant's trace while it runs (a trace must name one); replaced by the real one if it fails."""


def swarm_config(data: dict[str, Any]) -> SwarmConfig:
    """The configuration a seed's ``config`` (:meth:`SwarmConfig.to_json`) names; ``TypeError``/``ValueError`` when
    it names none."""
    values = dict(data)
    runner = str(values.pop(MODEL_RUNNER))
    steps = int(values.pop("steps"))
    return SwarmConfig(SchedulerSetup(**values), runner, steps, 0)


@attrs.frozen
class Mutants:
    """A batch of mutants: the seed they come from, and the other seed of its configuration splices take from."""

    seed: Seed
    config: SwarmConfig  # the seed's
    program: tuple[Operation, ...]
    other: tuple[Operation, ...]


class Guidance:
    """One guided scheduler worker's search beyond the shared :class:`~kvfuzz.campaign.feedback.Feedback` (its
    coverage, seeds and bandit): configurations refused and stratified fresh draws, and batches of mutants (see the
    module)."""

    def __init__(
        self,
        target: SchedulerTarget,
        options: SchedulerCampaignOptions,
        scope: Optional[Scope],
        state: Any,
        slot: int,
    ) -> None:
        self.target = target
        self.options = options
        pool = SeedPool(state / SEED_DIRECTORY, target.name, options.database) if options.guided else None
        self.feedback: Feedback[SwarmConfig] = Feedback(scope if scope is not None else Scope(()), slot, pool)
        self.refused: dict[tuple[SchedulerSetup, str], ValueError] = {}
        self.strata: Counter[tuple[str, Any]] = Counter()  # (stratified row, value) -> fresh draws that took it

    # -- the batch's configuration -----------------------------------------------------------------------------

    def validate(self, setup: SchedulerSetup, runner: str) -> None:
        """The target's validation, a refusal remembered: a configuration refused once is refused at once."""
        known = self.refused.get((setup, runner))
        if known is not None:
            raise known
        try:
            self.target.validate(setup, runner)
        except ValueError as error:
            self.refused[(setup, runner)] = error
            raise

    def plan(
        self,
        rng: random.Random,
        number: int,
        examples: int,
        ends: Optional[float],
        batch_seconds: Optional[float],
        fresh: Callable[[Mapping[str, Any]], SwarmConfig],
    ) -> tuple[BatchPlan, Optional[Mutants]]:
        """The next batch: mutants of a seed (guided, with seeds, for the share mutants earn), else a Hypothesis batch
        on a configuration the bandit chose or ``fresh(pins)`` drew (``pins``: rows held for this draw besides the
        campaign's own)."""
        feedback = self.feedback
        if feedback.mutating(rng):
            mutants = self._mutants(rng)
            if mutants is not None:
                config = mutants.config
                feedback.begin(config, config.to_json(), mutated=mutants.seed.digest)
                return BatchPlan.of(number, config, rng.randrange(2**32), examples, ends, batch_seconds), mutants
        arm = feedback.arm(rng)
        config = arm if arm is not None else self._fresh(rng, fresh)
        feedback.begin(config, config.to_json(), drawn_fresh=arm is None)
        return BatchPlan.of(number, config, rng.randrange(2**32), examples, ends, batch_seconds), None

    def _fresh(self, rng: random.Random, fresh: Callable[[Mapping[str, Any]], SwarmConfig]) -> SwarmConfig:
        """A fresh draw holding the value of a stratified row drawn least so far (of every stratified row's values;
        the campaign's pins left as they are), the other rows drawn by their weights; where nothing is valid with
        it, a plain draw (the value held counted as tried). One value is held at a time, so that values valid only
        with another row's commonest value (the P/D connector needs the full-attention model) get their turns."""
        pinned = dict(self.options.pins)
        stratified = [row for row in self.target.dimensions if row.stratified and row.name not in pinned]
        held = {}
        if stratified:
            counts = {(row.name, value): self.strata[(row.name, value)] for row in stratified for value in row.domain}
            least = min(counts.values())
            name, value = rng.choice([stratum for stratum, count in counts.items() if count == least])
            held[name] = value
        try:
            config = fresh(held)
        except NothingValid:  # nothing valid with that value: counted as tried, so that others come first
            for name, value in held.items():
                self.strata[(name, value)] += 1
            config = fresh({})
        drawn = config.to_json()
        for row in stratified:
            self.strata[(row.name, drawn[row.name])] += 1
        return config

    def _mutants(self, rng: random.Random) -> Optional[Mutants]:
        """A seed this engine accepts, parsed, and another of its configuration (None: the pool has none that runs
        here; those refused are dropped)."""
        chosen = self.feedback.seed_to_mutate(rng, self._read)
        if chosen is None:
            return None
        seed, (config, program), other = chosen
        try:
            spliced = program_from_json(list(other.program), config.setup) if other is not None else ()
        except SchedulerTraceError:
            spliced = ()
        return Mutants(seed, config, program, spliced)

    def _read(self, seed: Seed) -> tuple[SwarmConfig, tuple[Operation, ...]]:
        """The configuration and program of ``seed``, if this engine runs them (else ``TypeError``/``ValueError``/
        ``KeyError``: another version's seed, or a refused configuration)."""
        config = swarm_config(seed.config)
        self.validate(config.setup, config.model_runner)
        return config, program_from_json(list(seed.program), config.setup)

    # -- a batch of mutants ------------------------------------------------------------------------------------

    def run_mutants(
        self, plan: BatchPlan, mutants: Mutants, is_new: IsNew, rng: random.Random, journal: Optional[Journal]
    ) -> BatchResult:
        """``plan.examples`` mutants of the seed run as programs, each with every check, until one fails."""
        target, options, config = self.target, self.options, plan.config
        started = time.perf_counter()
        examples = steps = 0
        for _ in range(plan.examples):
            program = mutate(mutants.program, config.setup, rng, mutants.other)
            try:
                program = program_from_json([operation.to_json() for operation in program], config.setup)
            except SchedulerTraceError:  # the mutator's invariant broken: skipped, never run
                continue
            trace = SchedulerTrace(
                target.name, config.setup, config.model_runner, target.version(), program, RUNNING, False
            )
            if journal is not None:
                journal.begin_example(journal_configuration(config.setup, config.model_runner))
                for operation in program:
                    journal.call(operation.to_json())
            examples += 1
            steps += sum(isinstance(operation, Step) for operation in program)
            try:
                with searching_until(plan.searched_by):
                    replayed = target.replay(trace, options.call_timeout)
            except ReplayRefused:  # this engine cannot run the seed's configuration after all: dropped
                if self.feedback.pool is not None:
                    self.feedback.pool.drop(mutants.seed)
                break
            except SearchCutOff:  # the batch's time is up: this mutant abandoned, the batch ends
                break
            if replayed.error is not None:
                return self._failed(plan, trace, replayed.error, examples, steps, started, is_new)
        outcome = Outcome(config.setup, examples, steps, 0, 0, time.perf_counter() - started, None, "")
        return BatchResult(outcome, None, None)

    def _failed(
        self,
        plan: BatchPlan,
        trace: SchedulerTrace,
        error: Exception,
        examples: int,
        steps: int,
        started: float,
        is_new: IsNew,
    ) -> BatchResult:
        """A mutant failed: saved as found; a new signature's trace shrunk by deletion (unless ``--no-shrink``), kept
        and confirmed by a replay; a known one's removed."""
        name = self.target.name
        failed = attrs.evolve(trace, failure=RecordedFailure.of(error))
        program = program_source(trace.program)
        outcome = Outcome(plan.config.setup, examples, steps, 0, 0, time.perf_counter() - started, error, program)
        signature = scheduler_signature(name, error)
        first = save_scheduler_trace(failed, self.options.corpus)
        if not is_new(signature, first):
            if first.written:
                first.path.unlink(missing_ok=True)
            return BatchResult(outcome, signature, first)
        note = f"found by a mutant of seed {self.feedback.mutated}"
        if first.error is not None:
            return BatchResult(outcome, signature, first, saved=first, note=note, new=True)
        if not self.options.shrink:
            return confirmed(
                self.target, self.options, outcome, signature, first, first, f"{note}; not shrunk (--no-shrink)"
            )
        return by_deletion(self.target, self.options, plan, outcome, signature, first, note)


def guidance(target: SchedulerTarget, options: SchedulerCampaignOptions, state: Any, slot: int) -> Optional[Guidance]:
    """The worker's guidance when the campaign measures coverage, else None."""
    if not options.coverage:
        return None
    scope = target.scope() if target.scope is not None else engine_scope(target.name)
    return Guidance(target, options, scope, state, slot)
