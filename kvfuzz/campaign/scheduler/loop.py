"""One batch of a scheduler campaign's worker (:mod:`kvfuzz.campaign.scheduler.workers`): a configuration drawn
from the swarm table and a Hypothesis seed, both from the worker's seed stream, searched for ``batch_examples``
examples without shrinking. A failure's signature decides what happens next:

* new (the batch claims it: no corpus trace knows it, and no worker met it before): the failing example was saved
  the moment it failed (before shrinking); the batch is searched again with the same seed and shrinking on, which
  finds the same example and shrinks it; the shrunk trace replaces the first when it fails with the same
  signature. Otherwise (Hypothesis's shrinking drifted to another failure, which is a finding of its own with its
  shrunk trace, or did not fail again) the first trace is shrunk by deleting operations under its signature
  (:mod:`kvfuzz.scheduler.shrinking`) and replaces itself. One replay confirms the trace kept; a signature a
  corpus trace of a fixed bug reproduces is new too, a regression, and says so;
* known (from a corpus trace) or met earlier in the campaign: counted, and the unshrunk trace saved for it removed.

A batch's search ends after its ``batch_seconds`` (``--batch-seconds``; by default a twentieth of the campaign's
duration, at least :data:`LEAST_BATCH_SECONDS`), so that no one slow configuration (a pool of one-token blocks and a
six-token budget once ran 53,525 steps, most of a ten-minute campaign) holds the campaign: the examples it ran count,
and a failure it met is shrunk as usual. A batch ends with the campaign's duration too: its search is cut off where it
is (the example it was running abandoned, what it ran counted), and so is shrinking (a cut-off shrinking keeps the
example as found, and says so); a stop (Ctrl-C, SIGTERM) cuts the search off the same way, and while shrinking keeps the
finding, with its trace as found.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import attrs

from kvfuzz.campaign.rerun import Rerun
from kvfuzz.campaign.scheduler.target import SchedulerTarget
from kvfuzz.campaign.settings import Settings
from kvfuzz.program.safeguards import Journal
from kvfuzz.scheduler.program import program_source
from kvfuzz.scheduler.recorder import save_scheduler_trace
from kvfuzz.scheduler.replay_result import SchedulerReplay
from kvfuzz.scheduler.search import Outcome, SearchCutOff
from kvfuzz.scheduler.shrinking import confirm, shrink_saved
from kvfuzz.scheduler.signature import scheduler_signature
from kvfuzz.scheduler.swarm import SwarmConfig
from kvfuzz.scheduler.trace import SchedulerTrace
from kvfuzz.shrink.signature import Signature
from kvfuzz.swarm_table import Pins
from kvfuzz.trace_saving import SavedTrace

BATCH_EXAMPLES = 25
"""Examples per configuration drawn, unless told otherwise."""
BATCH_SHARE = 20
"""A campaign with a duration gives each batch's search at most 1/BATCH_SHARE of it, unless told otherwise."""
LEAST_BATCH_SECONDS = 10.0
"""The least a batch's search is given by default (a short campaign's batches would otherwise find nothing)."""


def default_batch_seconds(duration: Optional[float]) -> Optional[float]:
    """The cap on a batch's search a campaign of ``duration`` seconds has unless told: None without a duration (a
    campaign bound by examples runs each batch to its end, so that its seed decides what it finds)."""
    return None if duration is None else max(LEAST_BATCH_SECONDS, duration / BATCH_SHARE)


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
    database: Optional[str] = None  # redis://HOST:PORT/N: claims shared, new findings' traces stored there too
    workers: int = 1  # worker processes (kvfuzz.campaign.supervisor)
    coverage: bool = False  # measure the engine's coverage (kvfuzz.campaign.feedback)
    guided: bool = False  # and use it: seeds, mutants, a bandit over configurations (implies coverage)
    batch_seconds: Optional[float] = None  # the most a batch's search runs (--batch-seconds); None: to its end

    def rerun(self) -> Rerun:
        own = SchedulerRerun(
            self.scheduler,
            self.batch_examples,
            self.batch_seconds,
            self.shrink,
            self.isolate,
        )
        return Rerun.of(own, Settings.of(self), tuple(map(str, self.known)))


@attrs.frozen
class SchedulerRerun:
    """A scheduler campaign's own settings of its rerun (:class:`~kvfuzz.campaign.rerun.TargetRerun`)."""

    scheduler: str
    batch_examples: int  # examples per configuration drawn
    batch_seconds: Optional[float]  # --batch-seconds: the most a batch's search ran (None: no cap)
    shrink: bool
    isolate: bool

    def target(self) -> list[str]:
        return ["--scheduler", self.scheduler]

    def options(self) -> list[str]:
        args = ["--batch-examples", str(self.batch_examples)]
        if self.batch_seconds is not None:
            args += ["--batch-seconds", repr(self.batch_seconds)]
        if not self.shrink:
            args.append("--no-shrink")
        if self.isolate:
            args.append("--isolate")
        return args

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class BatchPlan:
    """One batch: its configuration, its Hypothesis seed, its examples, and when its search and its shrinking are cut
    off (``searched_by`` is never later than ``ends``)."""

    number: int  # batches drawn before it
    config: SwarmConfig
    seed: int
    examples: int
    ends: Optional[float] = None  # time.monotonic() past which its shrinking is cut off (the campaign's end)
    searched_by: Optional[float] = None  # past which its search is (ends, or its batch_seconds first); None: never

    @classmethod
    def of(
        cls,
        number: int,
        config: SwarmConfig,
        seed: int,
        examples: int,
        ends: Optional[float],
        batch_seconds: Optional[float],
    ) -> BatchPlan:
        """A batch planned now: its search cut off after ``batch_seconds`` (None: no cap) or at ``ends``."""
        capped = None if batch_seconds is None else time.monotonic() + batch_seconds
        searched_by = min((end for end in (ends, capped) if end is not None), default=None)
        return cls(number, config, seed, examples, ends, searched_by)


@attrs.frozen
class BatchResult:
    """What one batch found (``failure`` None: it passed), and for a new failure, its shrinking."""

    outcome: Outcome
    signature: Optional[Signature]
    first: Optional[SavedTrace[SchedulerTrace]]  # the failing example as found, saved before shrinking
    shrunk: Optional[Outcome] = None  # the search again with shrinking (new failures only)
    saved: Optional[SavedTrace[SchedulerTrace]] = None  # the trace the finding names
    note: Optional[str] = None
    reproduced: Optional[int] = None  # the confirming replay failed the same way (1) or not (0)
    new: bool = False  # the failure's signature was claimed by this batch (shrunk and saved), not known or met before
    drifted: Optional[Drifted] = None  # the other failure shrinking met, when it drifted to another signature
    interrupted: bool = False  # a stop (Ctrl-C, SIGTERM) arrived while shrinking: the campaign ends after this batch


@attrs.frozen
class Drifted:
    """The failure a new failure's shrinking drifted to (another signature), and its shrunk trace where it was kept."""

    signature: Signature
    outcome: Outcome  # the shrinking search, whose failure it is
    saved: Optional[SavedTrace[SchedulerTrace]]
    new: bool  # claimed by this batch: its trace kept


CUT_OFF_RETRY = 0.01
"""Seconds after which a cut-off swallowed where Python cannot raise (a garbage-collector callback, a ``__del__``)
is raised again."""


@contextlib.contextmanager
def searching_until(deadline: Optional[float]) -> Iterator[None]:
    """While active, :class:`~kvfuzz.scheduler.search.SearchCutOff` is raised in the main thread once
    ``time.monotonic()`` passes ``deadline`` (None, or outside the main thread: never). The alarm may fire inside a
    garbage-collector callback (Hypothesis registers one), where Python prints the exception as unraisable and goes
    on: that one is not printed, and the cut-off is raised again :data:`CUT_OFF_RETRY` seconds later."""
    if deadline is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise SearchCutOff()

    def expired(signum: int, frame: Any) -> None:
        raise SearchCutOff()

    def unraisable(raised: Any) -> None:
        if isinstance(raised.exc_value, SearchCutOff):
            signal.setitimer(signal.ITIMER_REAL, CUT_OFF_RETRY)
        else:
            hook(raised)

    previous, hook = signal.signal(signal.SIGALRM, expired), sys.unraisablehook
    sys.unraisablehook = unraisable
    signal.setitimer(signal.ITIMER_REAL, left)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        sys.unraisablehook = hook


def _until(deadline: Optional[float], search: Callable[[], Outcome]) -> Optional[Outcome]:
    """``search()`` cut off at ``deadline`` (its outcome says so); None when the cut-off came just as it returned
    (outside it: its outcome is lost, what it found is on disk)."""
    try:
        with searching_until(deadline):
            return search()
    except SearchCutOff:
        return None


IsNew = Callable[[Signature, Optional[SavedTrace[SchedulerTrace]]], bool]
"""Whether a failure's signature is new, claiming it when it is (the batch then shrinks and saves it), told the
failing example as found where it is saved already."""

Runner = Callable[[BatchPlan, IsNew], BatchResult]
"""Runs one batch; told by the predicate whether a signature is new (to be shrunk and saved)."""


def run_batch(
    target: SchedulerTarget,
    options: SchedulerCampaignOptions,
    plan: BatchPlan,
    is_new: IsNew,
    journal: Optional[Journal] = None,
) -> BatchResult:
    """One batch in this process: searched without shrinking; a new failure searched again with shrinking, its
    shrunk trace saved and replayed once; a known one's unshrunk trace removed. ``journal`` keeps the running
    example's program on disk (the worker's heartbeat, and what its death leaves)."""
    recorder = target.recorder(target.name, options.corpus)
    searched = _until(
        plan.searched_by,
        lambda: target.search(plan.config, plan.examples, plan.seed, False, recorder, options.call_timeout, journal),
    )
    if searched is None:  # cut off as it returned: its examples are not counted, a failure it met is on disk
        return BatchResult(Outcome(plan.config.setup, 0, 0, 0, 0, 0.0, None, "", cut_off=True), None, None)
    outcome = searched
    if outcome.harness is not None:  # kvfuzz's own code failed: the campaign ends on it (the worker says so)
        raise outcome.harness
    if outcome.failure is None:
        return BatchResult(outcome, None, None)
    signature = scheduler_signature(target.name, outcome.failure)
    first = recorder.first
    if not is_new(signature, first):
        if first is not None and first.written:
            first.path.unlink(missing_ok=True)  # the finding is saved already (known, or met earlier)
        return BatchResult(outcome, signature, first)
    if not options.shrink:
        return BatchResult(outcome, signature, first, saved=first, note="not shrunk (--no-shrink)", new=True)
    shrinker = target.recorder(target.name, options.corpus)
    try:
        shrinking = _until(
            plan.ends,
            lambda: target.search(plan.config, plan.examples, plan.seed, True, shrinker, options.call_timeout, journal),
        )
    except KeyboardInterrupt:  # the campaign was stopped while shrinking: the finding stays, as found
        note = "shrinking interrupted (the campaign was stopped): the trace is the example as found, not shrunk"
        return BatchResult(outcome, signature, first, None, first, note, new=True, interrupted=True)
    if shrinking is None or shrinking.cut_off:
        note = "shrinking cut off at the campaign's end (--duration): the trace is the example as found, not shrunk"
        return BatchResult(outcome, signature, first, None, first, note, new=True)
    shrunk = shrinking
    if shrunk.harness is not None:
        raise shrunk.harness
    if shrunk.failure is None:
        note = "the batch searched again to shrink it did not fail"
        return by_deletion(target, options, plan, outcome, signature, first, note, shrunk)
    other = scheduler_signature(target.name, shrunk.failure)
    if other != signature:  # the first trace stays; the other failure's shrunk trace is kept beside it
        new = is_new(other, None)  # a known (or earlier) other failure is counted, its trace not kept
        kept = save_scheduler_trace(shrinker.latest[0], options.corpus) if new and shrinker.latest else None
        where = f", its shrunk trace kept: {kept.path}" if kept is not None and kept.error is None else ""
        note = f"Hypothesis's shrinking met another failure ({other}{where})"
        drifted = Drifted(other, shrunk, kept if kept is not None and kept.error is None else None, new)
        return by_deletion(target, options, plan, outcome, signature, first, note, shrunk, drifted)
    saved = shrinker.finish(shrunk.failure, shrunk=True)
    if saved is None or saved.error is not None:
        return BatchResult(outcome, signature, first, shrunk, saved or first, new=True)
    for found in (first, shrinker.first):  # the example as found, saved before shrinking: the shrunk one replaces it
        if found is not None and found.written and found.path != saved.path:
            found.path.unlink(missing_ok=True)
    return confirmed(target, options, outcome, signature, first, saved, None, shrunk)


def by_deletion(
    target: SchedulerTarget,
    options: SchedulerCampaignOptions,
    plan: BatchPlan,
    outcome: Outcome,
    signature: Signature,
    first: Optional[SavedTrace[SchedulerTrace]],
    why: str,
    shrunk: Optional[Outcome] = None,
    drifted: Optional[Drifted] = None,
) -> BatchResult:
    """A new failure that Hypothesis's shrinking did not shrink (``why``: it drifted to another failure, or did not
    fail again; or the failure is a guided campaign's mutant): its trace as found shrunk by deleting operations under
    its signature (:mod:`kvfuzz.scheduler.shrinking`) and the trace kept confirmed by a replay; where a shorter one
    was kept, the finding's program and words are its. ``shrunk`` is Hypothesis's shrinking search (None: none ran)."""
    if first is None or first.error is not None:
        note = f"{why}: the trace is the example as found, not shrunk"
        return BatchResult(outcome, signature, first, shrunk, first, note, new=True, drifted=drifted)
    replay = replayer(target, options)
    try:
        saved, deleted, error = shrink_saved(first, signature, replay, plan.ends)
    except KeyboardInterrupt:  # the campaign was stopped while shrinking: the finding stays, as found
        note = f"{why}; shrinking interrupted (the campaign was stopped): the trace is the example as found"
        return BatchResult(outcome, signature, first, shrunk, first, note, new=True, drifted=drifted, interrupted=True)
    if error is not None:
        outcome = attrs.evolve(outcome, failure=error, program=program_source(saved.trace.program))
    return confirmed(
        target, options, outcome, signature, first, saved, f"{why}; the example as found {deleted}", shrunk, drifted
    )


def confirmed(
    target: SchedulerTarget,
    options: SchedulerCampaignOptions,
    outcome: Outcome,
    signature: Signature,
    first: Optional[SavedTrace[SchedulerTrace]],
    saved: SavedTrace[SchedulerTrace],
    note: Optional[str],
    shrunk: Optional[Outcome] = None,
    drifted: Optional[Drifted] = None,
) -> BatchResult:
    """A new finding whose trace is ``saved``, confirmed by one replay (what it found otherwise added to ``note``)."""
    reproduced, unconfirmed = confirm(saved.trace, signature, replayer(target, options))
    note = unconfirmed if note is None else note if unconfirmed is None else f"{note}; {unconfirmed}"
    return BatchResult(outcome, signature, first, shrunk, saved, note, reproduced, new=True, drifted=drifted)


def replayer(target: SchedulerTarget, options: SchedulerCampaignOptions) -> Callable[[SchedulerTrace], SchedulerReplay]:
    """``target``'s replay of a trace under the campaign's watchdog (``--call-timeout``)."""
    return lambda trace: target.replay(trace, options.call_timeout)
