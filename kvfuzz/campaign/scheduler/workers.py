"""A scheduler campaign on the campaign's one supervisor (:mod:`kvfuzz.campaign.supervisor`): the scheduler target of
:class:`~kvfuzz.campaign.protocol.CampaignTarget`, whose workers run batches (:mod:`~kvfuzz.campaign.scheduler.loop`).

* Each worker draws its own batches: its configurations and Hypothesis seeds come from its own seed stream. The first
  worker's stream is the campaign's seed itself, so a one-worker campaign runs the batches a scheduler campaign has
  always run under that seed; every other slot (and every replacement of a dead worker) derives its own
  (:func:`~kvfuzz.campaign.protocol.worker_seed`).
* The known findings (the corpus's scheduler traces that reproduce here) are replayed once, in the supervisor,
  before any worker starts; the workers inherit them. A failure met is claimed in the campaign's signature store
  (files, or the Redis ``--database`` names, shared by every machine): the worker that claims it first shrinks and
  saves it; every other meeting is counted. Claimed, it is already on disk as found (the recorder saves it before
  shrinking), and the claim names that trace, so a worker (or a supervisor) killed while shrinking loses nothing.
* Each worker keeps the running example's program in the journal every target writes
  (:class:`kvfuzz.program.safeguards.Journal`, its header naming the scheduler), which is also its heartbeat: a
  worker that dies, or hangs past any interrupt, leaves its program, which the supervisor recovers as a
  ``crash (SchedulerProcessDied)`` trace (not shrunk: every replay would kill the process). With ``--isolate`` each
  batch runs in a child of the worker (:mod:`~kvfuzz.campaign.scheduler.isolated`), which handles such deaths itself.
* A harness error (kvfuzz's own code failing in a worker) stops the whole campaign: never a finding.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Optional

import attrs

from kvfuzz.campaign.claims import WorkerClaims
from kvfuzz.campaign.cluster import ClusterFindings, is_redis
from kvfuzz.campaign.feedback import FeedbackJournal
from kvfuzz.campaign.known import KnownFindings, known_findings, stored_findings_known
from kvfuzz.campaign.messages import Batch, HarnessFailed, Said, Saved
from kvfuzz.campaign.process import HaltInterrupts
from kvfuzz.campaign.protocol import WorkerContext, worker_seed
from kvfuzz.campaign.report import CampaignResult
from kvfuzz.campaign.rerun import Rerun
from kvfuzz.campaign.scheduler.guided import Mutants, guidance
from kvfuzz.campaign.scheduler.isolated import isolated_runner, journal_target
from kvfuzz.campaign.scheduler.loop import BatchPlan, BatchResult, IsNew, SchedulerCampaignOptions, run_batch
from kvfuzz.campaign.scheduler.target import SchedulerTarget, SchedulerTraces, Search, recorded
from kvfuzz.campaign.settings import Settings
from kvfuzz.campaign.supervisor import Supervisor
from kvfuzz.program.safeguards import Journal, UserInterrupt
from kvfuzz.scheduler.harness import HarnessError
from kvfuzz.scheduler.program import program_source
from kvfuzz.scheduler.search import Outcome, SearchCutOff
from kvfuzz.scheduler.swarm import SwarmConfig, draw
from kvfuzz.scheduler.trace import SchedulerTrace
from kvfuzz.shrink.signature import Signature
from kvfuzz.trace_saving import SavedTrace


class SchedulerCampaign:
    """The scheduler target of a campaign (see the module); ``target`` is the engine it runs."""

    def __init__(self, options: SchedulerCampaignOptions, target: SchedulerTarget) -> None:
        self.options = options
        self.target = target
        self.settings = Settings.of(options)
        self.known = KnownFindings()  # set by prepare, before the workers are forked

    def prepare(self, event: Callable[[str], None]) -> KnownFindings:
        options = self.options
        source = SchedulerTraces(self.target, options.call_timeout)
        self.known = known_findings([*options.known, options.corpus], source)
        if is_redis(options.database):  # findings stored under an earlier signature's key: known under today's
            assert options.database is not None
            self.known = self.known.then(stored_findings_known(ClusterFindings(options.database), source))
        return self.known

    def seed_of(self, slot: int, incarnation: int) -> int:
        if (slot, incarnation) == (0, 0):
            return self.options.seed
        return worker_seed(self.options.seed, slot, incarnation)

    def search(self, worker: WorkerContext) -> None:
        _Worker(self, worker).search()

    def text(self, signature: dict[str, Optional[str]]) -> str:
        return str(Signature(**signature))  # type: ignore[arg-type]  # Signature.to_json()'s fields

    def rerun(self) -> Rerun:
        return self.options.rerun()

    def result_fields(self) -> dict[str, Any]:
        return {"allocators": (), "scheduler": self.options.scheduler}


class _Worker:
    """One worker's batches, and what it tells the supervisor of each."""

    def __init__(self, campaign: SchedulerCampaign, worker: WorkerContext) -> None:
        self.campaign = campaign
        self.options = campaign.options
        self.worker = worker
        self.target = attrs.evolve(campaign.target, search=_halted_searches(campaign.target.search, worker.halt))
        self.reporter = worker.reporter
        self.claims = WorkerClaims(worker, self.options.database, self.options.seed)
        self.guide = guidance(self.target, self.options, worker.state, worker.slot)  # None without --coverage

    def search(self) -> None:
        options, worker = self.options, self.worker
        rng = random.Random(worker.seed)
        journal: Optional[Journal] = None
        if options.isolate:
            runner = isolated_runner(self.target, options, self.reporter.beat)
        else:
            header = journal_target(self.target.name, self.target.version())
            feedback = self.guide.feedback if self.guide is not None else None
            journal = FeedbackJournal(options.corpus, header, {}, feedback, self.reporter.beat)

            def runner(plan: BatchPlan, is_new: IsNew) -> BatchResult:
                return run_batch(self.target, options, plan, is_new, journal)

        number = 0
        try:
            while not worker.stop.is_set() and not self._past_the_end():
                granted = worker.take_examples(options.batch_examples)
                if not granted:
                    return
                plan, mutants = self.plan(rng, number, granted)
                number += 1
                try:
                    if self.guide is not None and mutants is not None:
                        result = self.guide.run_mutants(plan, mutants, self.claimer(plan), rng, journal)
                    else:
                        result = runner(plan, self.claimer(plan))
                except HarnessError as error:  # kvfuzz's own code failed: the campaign ends on it
                    worker.settle_examples(granted, 0)
                    self.reporter.send(HarnessFailed(worker.slot, error.describe()))
                    return
                worker.settle_examples(granted, result.outcome.examples)
                if self.guide is not None:
                    self.reporter.send(self.guide.feedback.end())
                self.record(plan, result)
        finally:
            if self.guide is not None:
                self.guide.feedback.stop()
            if journal is not None:
                journal.close()

    def _past_the_end(self) -> bool:
        """Whether the campaign's duration is up: a batch drawn now would be cut off before its first example (a
        worker that shrank until the end once logged fourteen such empty batches before the campaign stopped it)."""
        return self.worker.ends is not None and time.monotonic() >= self.worker.ends

    def plan(self, rng: random.Random, number: int, examples: int) -> tuple[BatchPlan, Optional[Mutants]]:
        """The next batch: a configuration drawn from the swarm table; with coverage, what the guidance plans."""
        guide, pins = self.guide, dict(self.options.pins)
        if guide is None:
            config = draw(rng, self.target.validate, self.target.dimensions, pins)
            seed = rng.randrange(2**32)
            return BatchPlan.of(number, config, seed, examples, self.worker.ends, self.options.batch_seconds), None
        plan, mutants = guide.plan(
            rng,
            number,
            examples,
            self.worker.ends,
            self.options.batch_seconds,
            lambda held: draw(rng, guide.validate, self.target.dimensions, {**held, **pins}),
        )
        return plan, mutants

    def claimer(self, plan: BatchPlan) -> IsNew:
        """Whether a failure met in ``plan``'s batch is new (:meth:`WorkerClaims.claim`): the claim names the example
        as found, saved already."""
        met = recorded(plan.config.setup, plan.config.model_runner)

        def is_new(signature: Signature, first: Optional[SavedTrace[SchedulerTrace]]) -> bool:
            trace = str(first.path) if first is not None and first.error is None else None
            length = len(first.trace.program) if first is not None else 0
            return self.claims.claim(signature, met, length, trace)

        return is_new

    def record(self, plan: BatchPlan, result: BatchResult) -> None:
        """Count the batch (its search's examples count toward ``max_examples``, shrinking's do not; every step
        counts) and tell of its findings."""
        outcome = result.outcome
        self.reporter.phase = "searching"
        self.reporter.examples += outcome.examples
        self.reporter.steps += outcome.steps + (result.shrunk.steps if result.shrunk is not None else 0)
        entry = {
            **plan.config.to_json(),
            "hypothesis_seed": plan.seed,
            "examples": outcome.examples,
            "steps": outcome.steps,
            "preemptions": outcome.preemptions,
            "hit_tokens": outcome.hit_tokens,
            "released_rewrites": outcome.rewrites,  # async scheduling's: 0 under synchronous scheduling
            "lora_held_back": outcome.lora_held_back,  # steps the LoRA limit held a request back (0 without)
            "failure": None if result.signature is None else str(result.signature),
            **(self.guide.feedback.entry() if self.guide is not None else {}),
        }
        self.reporter.send(Batch(self.worker.slot, entry, plan.config.refused))
        if result.signature is None:
            return
        self.finding(plan, result.signature, result)
        drifted = result.drifted
        if drifted is not None:
            note = f"met while shrinking {result.signature} (the batch's first failure)"
            other = BatchResult(drifted.outcome, drifted.signature, drifted.saved, None, drifted.saved, note)
            self.finding(plan, drifted.signature, attrs.evolve(other, new=drifted.new))

    def finding(self, plan: BatchPlan, signature: Signature, result: BatchResult) -> None:
        """Tell the supervisor of the finding of ``signature`` that this batch claimed, shrank and saved (one it did
        not claim was counted when met)."""
        if not result.new:
            return
        met = recorded(plan.config.setup, plan.config.model_runner)
        same = result.shrunk is not None and result.shrunk.failure is not None and result.drifted is None
        shown = result.shrunk if same and result.shrunk is not None else result.outcome
        saved = result.saved
        note = self.claims.noted(
            signature, met, _note(plan, result, self.worker.slot if self.options.workers > 1 else None)
        )
        written = saved is not None and saved.error is None
        self.reporter.send(
            Saved(
                self.worker.slot,
                signature.key(),
                len(saved.trace.program) if saved is not None else 0,
                str(saved.path) if written and saved is not None else None,
                note,
                result.reproduced or 0,
                0 if result.reproduced is None else 1,
                _program(saved) or shown.program,
                shown.explanation(),
                saved.trace.to_json() if saved is not None and not written else None,
            )
        )
        shared = self.claims.share(saved.trace, signature, str(saved.path)) if written and saved is not None else None
        if shared is not None:
            self.reporter.send(Said(self.worker.slot, f"  {self.options.database}: {shared}"))


def _halted_searches(search: Search, halt: Any) -> Search:
    """``search``, interrupted by ``halt`` (Ctrl-C): a search without shrinking is cut off where it is
    (:class:`~kvfuzz.scheduler.search.SearchCutOff`: what it ran is counted), after which the worker sees ``stop``;
    a shrinking search is interrupted, the failure it shrinks on disk as found, and
    :func:`~kvfuzz.campaign.scheduler.loop.run_batch` keeps it so."""
    interrupts = HaltInterrupts(halt)

    def halted(config: SwarmConfig, examples: int, seed: int, shrink: bool, *rest: Any) -> Outcome:
        with interrupts.armed(UserInterrupt if shrink else SearchCutOff):
            return search(config, examples, seed, shrink, *rest)

    return halted


def _program(saved: Optional[SavedTrace[SchedulerTrace]]) -> str:
    """The program of the finding's trace, one operation a line, as the trace replays it (no-op aborts of finished
    requests are not in it), then the drain; "" without a trace."""
    if saved is None:
        return ""
    return program_source(saved.trace.program)


def _note(plan: BatchPlan, result: BatchResult, worker: Optional[int]) -> str:
    """The configuration the finding was met in (and by which worker, where there are several), and what became of
    its shrinking."""
    by = f" of worker {worker}" if worker is not None else ""
    where = f"found in batch {plan.number}{by} ({plan.config.describe()}, Hypothesis seed {plan.seed})"
    return f"{where}; {result.note}" if result.note else where


def run_scheduler_campaign(
    options: SchedulerCampaignOptions,
    target: SchedulerTarget,
    status: Optional[Callable[[str], None]] = None,
    event: Optional[Callable[[str], None]] = None,
) -> CampaignResult:
    """Run a scheduler campaign to its end on the campaign's supervisor (:class:`~kvfuzz.campaign.lock.CorpusInUse`
    when another campaign holds its corpus)."""
    return Supervisor(SchedulerCampaign(options, target), status, event).run()
