"""A scheduler campaign's batches: each draws a configuration from the swarm table and a Hypothesis seed, both from
the campaign's seed alone, and searches it for ``batch_examples`` examples, without shrinking. A failure's signature
decides what happens next:

* new: the failing example was saved the moment it failed (before shrinking); the batch is searched again with the
  same seed and shrinking on, which finds the same example and shrinks it; the shrunk trace replaces the first (when
  it fails with the same signature; otherwise both stay: the finding keeps its first trace, program and explanation,
  and the failure shrinking drifted to is a finding of its own, with its shrunk trace), and one replay confirms it;
  a signature a corpus trace of a fixed bug reproduces is new too, a regression, and says so;
* known (from a corpus trace) or met earlier in the campaign: counted, and the unshrunk trace saved for it removed.

Shrinking ends with the campaign's duration (a cut-off shrinking keeps the example as found, and says so), and a
stop (Ctrl-C, SIGTERM) while shrinking keeps the finding, with its trace as found, before the campaign ends.

The campaign ends when its duration is up (checked between batches), its examples are run, ``stop_after`` new
failures are found, or on Ctrl-C, SIGTERM or SIGHUP (the result is printed; what was found is kept: each failure's
trace is on disk before it is shrunk).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import attrs

import kvfuzz
from kvfuzz.campaign.report import CampaignResult, Finding
from kvfuzz.campaign.rerun import SchedulerRerun
from kvfuzz.campaign.scheduler.known import KnownFindings, known_signatures
from kvfuzz.campaign.scheduler.shared import share_finding
from kvfuzz.campaign.scheduler.target import SchedulerTarget, scheduler_signature
from kvfuzz.program.safeguards import user_interrupts
from kvfuzz.scheduler.harness import HarnessError
from kvfuzz.scheduler.journal import ProgramJournal
from kvfuzz.scheduler.pins import Pins
from kvfuzz.scheduler.recorder import SavedSchedulerTrace, save_scheduler_trace
from kvfuzz.scheduler.replay import ReplayRefused
from kvfuzz.scheduler.search import Outcome
from kvfuzz.scheduler.swarm import SwarmConfig, draw
from kvfuzz.shrink.signature import Signature

BATCH_EXAMPLES = 25
"""Examples per configuration drawn, unless told otherwise."""


@attrs.frozen
class SchedulerCampaignOptions:
    """What one scheduler campaign runs, and when it ends (at least one of ``duration``, ``max_examples`` is set)."""

    scheduler: str  # --scheduler
    seed: int  # every batch's configuration and Hypothesis seed derive from it
    corpus: Path  # where new failures are saved
    duration: Optional[float] = None  # seconds; None: no limit
    max_examples: Optional[int] = None  # examples, all batches together; None: no limit
    stop_after: Optional[int] = None  # new distinct failures; None: no limit
    batch_examples: int = BATCH_EXAMPLES
    known: tuple[Path, ...] = ()  # corpus directories whose scheduler traces' signatures are known findings
    shrink: bool = True
    isolate: bool = False  # each batch in a child process (kvfuzz.campaign.scheduler.isolated)
    call_timeout: Optional[float] = 60.0  # a step running longer is a hang (None: no watchdog)
    pins: Pins = ()  # swarm rows held at one value (--pin), checked against the rows' domains
    database: Optional[str] = None  # redis://HOST:PORT/N: new findings' traces are stored there too

    def rerun(self) -> SchedulerRerun:
        return SchedulerRerun(
            self.scheduler,
            self.seed,
            self.duration,
            self.max_examples,
            self.stop_after,
            self.batch_examples,
            str(self.corpus),
            tuple(map(str, self.known)),
            self.shrink,
            self.isolate,
            self.call_timeout,
            os.getcwd(),
            kvfuzz.__version__,
            self.pins,
            self.database,
        )


@attrs.frozen
class BatchPlan:
    """One batch: its configuration, its Hypothesis seed, its examples."""

    number: int  # batches drawn before it
    config: SwarmConfig
    seed: int
    examples: int
    shrink_by: Optional[float] = None  # time.monotonic() past which shrinking stops (the campaign's end); None: never


@attrs.frozen
class BatchResult:
    """What one batch found (``failure`` None: it passed), and for a new failure, its shrinking."""

    outcome: Outcome
    signature: Optional[Signature]
    first: Optional[SavedSchedulerTrace]  # the failing example as found, saved before shrinking
    shrunk: Optional[Outcome] = None  # the search again with shrinking (new failures only)
    saved: Optional[SavedSchedulerTrace] = None  # the trace the finding names
    note: Optional[str] = None
    reproduced: Optional[int] = None  # the confirming replay failed the same way (1) or not (0)
    drifted: Optional[Drifted] = None  # the other failure shrinking met, when it drifted to another signature
    interrupted: bool = False  # a stop (Ctrl-C, SIGTERM) arrived while shrinking: the campaign ends after this batch


@attrs.frozen
class Drifted:
    """The failure a new failure's shrinking drifted to (another signature), and its shrunk trace where it was kept."""

    signature: Signature
    outcome: Outcome  # the shrinking search, whose failure it is
    saved: Optional[SavedSchedulerTrace]


class ShrinkCutOff(BaseException):
    """The campaign's duration ran out while a failure was being shrunk (raised in the main thread by an alarm)."""


@contextlib.contextmanager
def shrinking_until(deadline: Optional[float]) -> Iterator[None]:
    """While active, :class:`ShrinkCutOff` is raised in the main thread once ``time.monotonic()`` passes
    ``deadline`` (None, or outside the main thread: never)."""
    if deadline is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise ShrinkCutOff()

    def expired(signum: int, frame: Any) -> None:
        raise ShrinkCutOff()

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, left)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


Runner = Callable[[BatchPlan, Callable[[Signature], bool]], BatchResult]
"""Runs one batch; told by the predicate whether a signature is new (to be shrunk and saved)."""


class SchedulerCampaign:
    """One scheduler campaign; :meth:`run` returns its :class:`CampaignResult`. ``event`` gets a line per new
    failure, ``status`` a progress line per batch."""

    def __init__(
        self,
        options: SchedulerCampaignOptions,
        target: SchedulerTarget,
        status: Optional[Callable[[str], None]] = None,
        event: Optional[Callable[[str], None]] = None,
        runner: Optional[Runner] = None,
    ) -> None:
        self.options = options
        self.target = target
        self.status = status or (lambda line: None)
        self.event = event or (lambda line: None)
        self.runner = runner or (lambda plan, is_new: run_batch(target, options, plan, is_new))
        self.findings: dict[str, Finding] = {}  # signature key -> finding, in the order first met
        self.known = KnownFindings()
        self.examples = 0
        self.steps = 0
        self.batches = 0
        self.refused = 0
        self.batch_log: list[dict[str, Any]] = []  # each batch: configuration, seed, examples, steps, what it reached
        self.started = time.monotonic()

    def run(self) -> CampaignResult:
        """The campaign to its end; a harness error (kvfuzz's own code failing, in the known corpus's replays or a
        batch) ends it at once, reported as such and never as a finding."""
        options = self.options
        self.started = time.monotonic()
        rng = random.Random(options.seed)
        errors: tuple[str, ...] = ()
        try:
            with user_interrupts():  # Ctrl-C, SIGTERM (timeout's) and SIGHUP end it with what it found
                self.known = known_signatures([*options.known, options.corpus], self.target, options.call_timeout)
                self.started = time.monotonic()
                ended_by = self._batches(rng)
        except KeyboardInterrupt:
            ended_by = "interrupted"
        except HarnessError as error:
            ended_by, errors = "harness error", (error.describe(),)
        findings = [finding for finding in self.findings.values() if finding.new]
        findings += [finding for finding in self.findings.values() if not finding.new]
        return CampaignResult(
            (),
            1,
            time.monotonic() - self.started,
            self.examples,
            self.steps,
            ended_by,
            tuple(findings),
            corpus=str(options.corpus),
            rerun=options.rerun(),
            scheduler=options.scheduler,
            batches=self.batches,
            refused=self.refused,
            batch_log=tuple(self.batch_log),
            errors=errors,
        )

    def _batches(self, rng: random.Random) -> str:
        """Run batches until the campaign's end; returns why it ended."""
        options = self.options
        while True:
            ending = self._ending()
            if ending is not None:
                return ending
            config = draw(rng, self.target.validate, self.target.dimensions, dict(options.pins))
            examples = options.batch_examples
            if options.max_examples is not None:
                examples = min(examples, options.max_examples - self.examples)
            ends = None if options.duration is None else self.started + options.duration
            plan = BatchPlan(self.batches, config, rng.randrange(2**32), examples, ends)
            self.refused += config.refused
            self.batches += 1
            started = time.monotonic()
            result = self.runner(plan, self._is_new)
            self._record(plan, result, started)
            self.status(self.progress_line())
            if result.interrupted:
                return "interrupted"

    def _ending(self) -> Optional[str]:
        options = self.options
        if options.max_examples is not None and self.examples >= options.max_examples:
            return "max-examples"
        if options.stop_after is not None and sum(finding.new for finding in self.findings.values()) >= (
            options.stop_after
        ):
            return "stop-after"
        if options.duration is not None and time.monotonic() - self.started >= options.duration:
            return "duration"
        return None

    def _is_new(self, signature: Signature) -> bool:
        return signature.key() not in self.known.known and signature.key() not in self.findings

    def progress_line(self) -> str:
        elapsed = time.monotonic() - self.started
        new = sum(finding.new for finding in self.findings.values())
        preemptions = sum(batch["preemptions"] for batch in self.batch_log)
        hits = sum(batch["hit_tokens"] for batch in self.batch_log)
        return (
            f"{elapsed:.0f} s: {self.batches} configurations, {self.examples} examples, {self.steps} steps "
            f"({self.steps / elapsed if elapsed else 0:.0f} steps/s), {preemptions} preemptions, {hits} prompt "
            f"tokens hit the cache; {new} new failures, {len(self.findings) - new} known met"
        )

    def _record(self, plan: BatchPlan, result: BatchResult, started: float) -> None:
        """Count the batch (begun at ``started``; its search's examples count toward ``max_examples``, shrinking's
        do not; every step counts) and its finding."""
        outcome = result.outcome
        found_at = (started - self.started + outcome.seconds, self.examples + outcome.examples)
        self.examples += outcome.examples
        self.batch_log.append(
            {
                **plan.config.to_json(),
                "hypothesis_seed": plan.seed,
                "examples": outcome.examples,
                "steps": outcome.steps,
                "preemptions": outcome.preemptions,
                "hit_tokens": outcome.hit_tokens,
                "released_rewrites": outcome.rewrites,  # async scheduling's: 0 under synchronous scheduling
                "lora_held_back": outcome.lora_held_back,  # steps the LoRA limit held a request back (0 without)
                "failure": None if result.signature is None else str(result.signature),
            }
        )
        self.steps += outcome.steps + (result.shrunk.steps if result.shrunk is not None else 0)
        signature = result.signature
        if signature is None:
            return
        self._finding(plan, signature, result, found_at)
        drifted = result.drifted
        if drifted is not None:
            note = f"met while shrinking {signature} (the batch's first failure)"
            other = BatchResult(drifted.outcome, drifted.signature, drifted.saved, None, drifted.saved, note)
            self._finding(plan, drifted.signature, other, found_at)

    def _finding(self, plan: BatchPlan, signature: Signature, result: BatchResult, found_at: tuple[float, int]) -> None:
        """Count or claim the finding of ``signature`` that ``result`` met."""
        outcome = result.outcome
        key = signature.key()
        earlier = self.findings.get(key)
        if earlier is not None:
            self.findings[key] = attrs.evolve(earlier, seen=earlier.seen + 1)
            return
        setup, runner = plan.config.setup, plan.config.model_runner
        if key in self.known.known:
            known = self.known.credit(key, setup, runner)
            self.findings[key] = Finding(signature.to_json(), str(signature), False, 1, *found_at, known=known)
            return
        same = result.shrunk is not None and result.shrunk.failure is not None and result.drifted is None
        shown = result.shrunk if same and result.shrunk is not None else outcome
        saved = result.saved
        regression = (
            f"REGRESSION: a fixed bug is back, {self.known.credit(key, setup, runner, regression=True)}"
            if key in self.known.regressions
            else None
        )
        self.findings[key] = Finding(
            signature.to_json(),
            str(signature),
            True,
            1,
            *found_at,
            program_length=len(result.first.trace.program) if result.first is not None else None,
            shrunk_length=len(saved.trace.program) if saved is not None else None,
            trace=str(saved.path) if saved is not None and saved.error is None else None,
            note=_note(plan, result) if regression is None else f"{regression}; {_note(plan, result)}",
            reproduced=result.reproduced,
            replays=0 if result.reproduced is None else 1,
            program=_program(saved) or shown.program or None,
            explanation=shown.explanation() or None,
            unsaved_trace=saved.trace.to_json() if saved is not None and saved.error is not None else None,
        )
        self.event(
            f"new failure{' (a regression)' if regression else ''}: {signature} ({plan.config.describe()}); "
            f"trace: {self.findings[key].trace}"
        )
        if self.options.database is not None and saved is not None and saved.error is None:
            shared = share_finding(self.options.database, saved.trace, signature, self.options.seed, str(saved.path))
            self.event(f"  {self.options.database}: {shared}")


def _program(saved: Optional[SavedSchedulerTrace]) -> str:
    """The program of the finding's trace, one operation a line, as the trace replays it (no-op aborts of finished
    requests are not in it), then the drain; "" without a trace."""
    if saved is None:
        return ""
    return "\n".join([*(operation.source("state") for operation in saved.trace.program), "state.drain()"])


def _note(plan: BatchPlan, result: BatchResult) -> str:
    """The configuration the finding was met in, and what became of its shrinking."""
    where = f"found in batch {plan.number} ({plan.config.describe()}, Hypothesis seed {plan.seed})"
    return f"{where}; {result.note}" if result.note else where


def run_batch(
    target: SchedulerTarget,
    options: SchedulerCampaignOptions,
    plan: BatchPlan,
    is_new: Callable[[Signature], bool],
    journal: Optional[ProgramJournal] = None,
) -> BatchResult:
    """One batch in this process: searched without shrinking; a new failure searched again with shrinking, its
    shrunk trace saved and replayed once; a known one's unshrunk trace removed. ``journal`` keeps the running
    example's program on disk (an isolated batch's)."""
    recorder = target.recorder(target.name, options.corpus)
    outcome = target.search(plan.config, plan.examples, plan.seed, False, recorder, options.call_timeout, journal)
    if outcome.harness is not None:  # kvfuzz's own code failed: the campaign ends on it (SchedulerCampaign.run)
        raise outcome.harness
    if outcome.failure is None:
        return BatchResult(outcome, None, None)
    signature = scheduler_signature(target.name, outcome.failure)
    first = recorder.first
    if not is_new(signature):
        if first is not None and first.written:
            first.path.unlink(missing_ok=True)  # the finding is saved already (known, or met earlier)
        return BatchResult(outcome, signature, first)
    if not options.shrink:
        return BatchResult(outcome, signature, first, saved=first, note="not shrunk (--no-shrink)")
    shrinker = target.recorder(target.name, options.corpus)
    try:
        with shrinking_until(plan.shrink_by):
            shrunk = target.search(plan.config, plan.examples, plan.seed, True, shrinker, options.call_timeout, journal)
    except ShrinkCutOff:
        note = "shrinking cut off at the campaign's end (--duration): the trace is the example as found, not shrunk"
        return BatchResult(outcome, signature, first, None, first, note)
    except KeyboardInterrupt:  # the campaign was stopped while shrinking: the finding stays, as found
        note = "shrinking interrupted (the campaign was stopped): the trace is the example as found, not shrunk"
        return BatchResult(outcome, signature, first, None, first, note, interrupted=True)
    if shrunk.harness is not None:
        raise shrunk.harness
    if shrunk.failure is None:
        note = "the batch searched again to shrink it did not fail: the trace is the example as found, not shrunk"
        return BatchResult(outcome, signature, first, shrunk, first, note)
    other = scheduler_signature(target.name, shrunk.failure)
    if other != signature:  # the first trace stays; the other failure's shrunk trace is kept beside it
        new = is_new(other)  # a known (or earlier) other failure is counted, its trace not kept
        kept = save_scheduler_trace(shrinker.latest[0], options.corpus) if new and shrinker.latest else None
        where = f", its shrunk trace kept: {kept.path}" if kept is not None and kept.error is None else ""
        note = f"shrinking met another failure ({other}{where}): the trace is the example as found, not shrunk"
        drifted = Drifted(other, shrunk, kept if kept is not None and kept.error is None else None)
        return BatchResult(outcome, signature, first, shrunk, first, note, drifted=drifted)
    saved = shrinker.finish(shrunk.failure, shrunk=True)
    if saved is None or saved.error is not None:
        return BatchResult(outcome, signature, first, shrunk, saved or first)
    for found in (first, shrinker.first):  # the example as found, saved before shrinking: the shrunk one replaces it
        if found is not None and found.written and found.path != saved.path:
            found.path.unlink(missing_ok=True)
    try:
        replayed = target.replay(saved.trace, options.call_timeout)
    except ReplayRefused as refused:
        return BatchResult(outcome, signature, first, shrunk, saved, f"not confirmed by a replay: {refused}")
    same = replayed.error is not None and scheduler_signature(target.name, replayed.error) == signature
    unconfirmed = None if same else f"the shrunk trace's replay found: {replayed.describe_failure()}"
    return BatchResult(outcome, signature, first, shrunk, saved, unconfirmed, int(same))
