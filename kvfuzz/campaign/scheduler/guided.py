"""Coverage in a scheduler campaign's worker (``--coverage``), and coverage as its search's signal (``--guided``).

With ``--coverage`` the worker measures the lines and branches of the engine's code under test that its examples
reach (:mod:`kvfuzz.coverage`) and tells the campaign what each batch reached first (:class:`~kvfuzz.campaign.
messages.Covered`); the search is the blind one.

With ``--guided`` the worker also uses it:

* each example whose program reached a point no earlier example of the worker had is kept, with its configuration,
  in the seed pool (:mod:`kvfuzz.campaign.seeds`, shared by the campaign's workers and later campaigns on the corpus,
  and through Redis with ``--database``);
* once the pool holds seeds, half the batches mutate them (:mod:`kvfuzz.scheduler.mutate`): each example of such a
  batch is a mutant of one seed (spliced with another of its configuration), run as a program (the trace replay's
  code, every check on); the other half are Hypothesis batches as before;
* the configuration of a Hypothesis batch is one that still finds new coverage, drawn by a bandit
  (:mod:`kvfuzz.campaign.bandit`), or a fresh draw of the swarm table; a configuration the engine refused is
  remembered and refused at once if drawn again, without asking the engine. A fresh draw takes the values of each
  stratified row (``Dimension.stratified``: vLLM's model, whose kinds run different KV-cache managers) in turn, the
  one drawn least so far first, so that no kind waits on its weight's luck: a ten-minute campaign once drew the
  Mamba hybrid in none of its 47 batches. The KV connector's row is stratified too (a ten-minute campaign of 195
  batches drew the P/D connector, which needs full attention, in none); one row's value is held per draw.

A failure of a mutant is a finding like any: claimed by signature, saved as found (not shrunk: a mutant is no
Hypothesis example to shrink), and confirmed by a replay.

Invariant: the example boundaries are the journal's (the worker's :class:`~kvfuzz.program.safeguards.Journal`
begins each example and tells the guidance, :meth:`Guidance.example_begins`), so coverage is taken per example in
Hypothesis batches and in mutant batches alike; the points reached while an example's scheduler is built count for
that example.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from typing import Any, Callable, Mapping, Optional

import attrs

from kvfuzz.campaign.bandit import FRESH, Bandit
from kvfuzz.campaign.messages import Covered
from kvfuzz.campaign.scheduler.loop import BatchPlan, BatchResult, IsNew, SchedulerCampaignOptions, searching_until
from kvfuzz.campaign.scheduler.target import SchedulerTarget, scheduler_signature
from kvfuzz.campaign.seeds import SEED_DIRECTORY, Seed, SeedPool
from kvfuzz.coverage.measure import Reached, measurer
from kvfuzz.coverage.scope import Scope, engine_scope
from kvfuzz.program.safeguards import Journal
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.mutate import mutate
from kvfuzz.scheduler.program import Operation, Step
from kvfuzz.scheduler.recorder import save_scheduler_trace
from kvfuzz.scheduler.replay import ReplayRefused
from kvfuzz.scheduler.search import Outcome, SearchCutOff
from kvfuzz.scheduler.swarm import MODEL_RUNNER, NothingValid, SwarmConfig
from kvfuzz.scheduler.trace import (
    RecordedFailure,
    SchedulerTrace,
    SchedulerTraceError,
    journal_configuration,
    program_from_json,
)

MUTATE_SHARE = 0.5
"""The share of a guided worker's batches that mutate seeds, once there are seeds."""

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
    program: tuple[Operation, ...]
    other: tuple[Operation, ...]


class Guidance:
    """One worker's coverage and, when ``guided``, its seed pool and bandit (see the module)."""

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
        self.guided = options.guided
        self.slot = slot
        self.scope = scope if scope is not None else Scope(())
        self.files = self.scope.files()
        self.measurer = measurer(self.files)
        self.pool = SeedPool(state / SEED_DIRECTORY, target.name, options.database) if self.guided else None
        self.bandit = Bandit()
        self.arms: dict[str, SwarmConfig] = {}
        self.refused: dict[tuple[SchedulerSetup, str], ValueError] = {}
        self.program: list[dict[str, Any]] = []  # the running example's operations, as its journal lists them
        self.config: Optional[SwarmConfig] = None  # the running batch's configuration
        self.batch = Reached()  # the points the running batch reached first
        self.began = 0.0  # time.monotonic() when the running batch began
        self.mutated: Optional[str] = None  # the running batch's seed, when it mutates one
        self.drawn_fresh = False  # whether the running batch's configuration was drawn fresh from the swarm table
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
        """The next batch: mutants of a seed (guided, with seeds, half the time), else a Hypothesis batch on a
        configuration the bandit chose or ``fresh(pins)`` drew (``pins``: rows held for this draw besides the
        campaign's own)."""
        self.mutated, self.drawn_fresh = None, False
        if self.pool is not None:
            self.pool.refresh()
            if self.pool.seeds and rng.random() < MUTATE_SHARE:
                mutants = self._mutants(rng)
                if mutants is not None:
                    config = swarm_config(mutants.seed.config)
                    self.mutated = mutants.seed.digest
                    return BatchPlan.of(number, config, rng.randrange(2**32), examples, ends, batch_seconds), mutants
        arm = self.bandit.choose(rng) if self.guided else None
        self.drawn_fresh = arm is None
        config = self.arms[arm] if arm is not None else self._fresh(rng, fresh)
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
        assert self.pool is not None
        for _ in range(4):
            seed = self.pool.choose(rng)
            if seed is None:
                return None
            try:
                config = swarm_config(seed.config)
                self.validate(config.setup, config.model_runner)
                program = program_from_json(list(seed.program), config.setup)
            except (TypeError, ValueError, KeyError):  # another version's seed, or a refused configuration
                self.pool.drop(seed)
                continue
            other = self.pool.choose(rng, seed.config_key)
            try:
                spliced = program_from_json(list(other.program), config.setup) if other is not None else ()
            except SchedulerTraceError:
                spliced = ()
            return Mutants(seed, program, spliced)
        return None

    # -- examples and their coverage ---------------------------------------------------------------------------

    def example_begins(self) -> None:
        """The worker's journal begins an example: the one before it ended."""
        self.example_ended()

    def called(self, record: dict[str, Any]) -> None:
        """The worker's journal lists a call of the running example."""
        self.program.append(record)

    def begin(self, config: SwarmConfig) -> None:
        self.config = config
        self.program = []
        self.batch = Reached()
        self.began = time.monotonic()
        self.measurer.start()

    def example_ended(self) -> None:
        """The running example ended (the next starts, or the batch ended): what it reached first is taken, and its
        program kept as a seed when it reached any."""
        new = self.measurer.take()
        program, self.program = self.program, []
        if not new:
            return
        self.batch = self.batch | new
        if self.pool is not None and self.config is not None and program:
            self.pool.add(Seed.of(self.target.name, self.config.to_json(), program, len(new)))

    def end(self) -> Covered:
        """The batch ended: its last example's coverage taken, the bandit told; what it reached first, for the
        campaign."""
        self.example_ended()
        if self.config is not None:
            key = json.dumps(self.config.to_json(), sort_keys=True)
            self.arms[key] = self.config
            seconds = time.monotonic() - self.began
            self.bandit.record(key, len(self.batch), seconds)
            if self.drawn_fresh:
                self.bandit.record(FRESH, len(self.batch), seconds)
        return Covered(self.slot, self.batch.to_json(), self.scope.imported(self.files))

    def entry(self) -> dict[str, Any]:
        """The batch log's coverage fields for the batch that ended."""
        fields: dict[str, Any] = {
            "new_lines": len(self.batch.lines),
            "new_branches": len(self.batch.branches),
        }
        if self.guided:
            fields["mutated_seed"] = self.mutated
            fields["seeds"] = len(self.pool) if self.pool is not None else 0
        return fields

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
                if self.pool is not None:
                    self.pool.drop(mutants.seed)
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
        """A mutant failed: saved as found; a new signature's trace kept and confirmed by a replay, a known one's
        removed."""
        name = self.target.name
        failed = attrs.evolve(trace, failure=RecordedFailure.of(error))
        program = "\n".join([*(operation.source("state") for operation in trace.program), "state.drain()"])
        outcome = Outcome(plan.config.setup, examples, steps, 0, 0, time.perf_counter() - started, error, program)
        signature = scheduler_signature(name, error)
        first = save_scheduler_trace(failed, self.options.corpus)
        if not is_new(signature, first):
            if first.written:
                first.path.unlink(missing_ok=True)
            return BatchResult(outcome, signature, first)
        note = f"found by a mutant of seed {self.mutated} (not shrunk: a mutant is no Hypothesis example)"
        if first.error is not None:
            return BatchResult(outcome, signature, first, saved=first, note=note, new=True)
        try:
            replayed = self.target.replay(first.trace, self.options.call_timeout)
        except ReplayRefused as refused:
            return BatchResult(
                outcome, signature, first, saved=first, note=f"{note}; not confirmed: {refused}", new=True
            )
        same = replayed.error is not None and scheduler_signature(name, replayed.error) == signature
        if not same:
            note = f"{note}; its replay found: {replayed.describe_failure()}"
        return BatchResult(outcome, signature, first, None, first, note, int(same), new=True)


def guidance(target: SchedulerTarget, options: SchedulerCampaignOptions, state: Any, slot: int) -> Optional[Guidance]:
    """The worker's guidance when the campaign measures coverage, else None."""
    if not options.coverage:
        return None
    scope = target.scope() if target.scope is not None else engine_scope(target.name)
    return Guidance(target, options, scope, state, slot)
