"""Running a campaign: worker processes with disjoint seed streams, their failures merged and de-duplicated by
signature, dead workers reported with the program that killed them and replaced, until the campaign's end.

The campaign ends when its duration is up, when its examples are run, when ``stop_after`` new distinct failures
are found, or on Ctrl-C, SIGTERM or SIGHUP (:attr:`Campaign.signal` says which). Workers then stop searching; a
shrink in progress runs to its own time bound (on a signal it stops at once, and its finding says it stopped early),
and every claimed finding is saved before the result returns. Workers never outlive the campaign: a worker whose
campaign was killed stops by itself (:mod:`kvfuzz.lifeline`). One campaign at a time holds a local corpus
(:mod:`kvfuzz.campaign.lock`).
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import attrs

from kvfuzz.campaign.allocators import AllocatorCampaign, CampaignOptions
from kvfuzz.campaign.claims import judge
from kvfuzz.campaign.cluster import ClusterFindings, is_redis
from kvfuzz.campaign.coverage import CoverageTally
from kvfuzz.campaign.flag import Flag
from kvfuzz.campaign.known import KnownFindings
from kvfuzz.campaign.lock import CorpusLock
from kvfuzz.campaign.messages import (
    Batch,
    Claimed,
    Covered,
    Crashed,
    Done,
    HarnessFailed,
    Message,
    Progress,
    Said,
    Saved,
    Seen,
)
from kvfuzz.campaign.process import patience_of, worker_main
from kvfuzz.campaign.protocol import CampaignTarget, Channel, Death
from kvfuzz.campaign.report import CampaignResult, DeadWorker, Finding
from kvfuzz.campaign.rerun import Rerun
from kvfuzz.campaign.store import open_store
from kvfuzz.program.safeguards import deferred_interrupts, journal_path
from kvfuzz.saved import journals
from kvfuzz.scheduler.harness import HarnessError
from kvfuzz.trace_saving import show_hint

DEFAULT_DURATION = 600.0
"""Seconds a campaign runs unless told otherwise (``kvfuzz campaign``, the plugin's nightly profile)."""

STATE_DIRECTORY = ".kvfuzz-campaign"
"""Inside the corpus: the local example database and the workers' signature claims (hidden: never collected)."""

BATCH_LOG_LIMIT = 10_000
"""The batches a campaign's result lists (the last ones; ``batches`` counts them all): an allocator worker runs a few
batches a second, so an hours-long campaign on many workers would otherwise hold millions of entries."""


@attrs.define
class _Slot:
    """One worker slot: the process running in it now and what the campaign last heard from it."""

    process: Any  # multiprocessing.Process
    incarnation: int
    last_heard: float
    phase: str = "searching"
    done: bool = False
    examples: int = 0  # examples run in this slot, every incarnation together
    steps: int = 0  # steps run in this slot, every incarnation together


@attrs.define
class _Tally:
    """The campaign's running totals. Invariant: ``findings`` has one entry per signature key met, in the order first
    met; ``order`` lists the new ones' keys in that order."""

    examples: int = 0
    steps: int = 0
    findings: dict[str, Finding] = attrs.field(factory=dict)
    order: list[str] = attrs.field(factory=list)
    shrinking: dict[int, str] = attrs.field(factory=dict)  # slot -> key it shrinks
    dead: list[DeadWorker] = attrs.field(factory=list)
    errors: list[str] = attrs.field(factory=list)
    batches: int = 0  # batches the workers ran, all of them
    # the last BATCH_LOG_LIMIT batches' entries, as they end (an allocator worker's batches take a fraction of a second)
    batch_log: collections.deque[dict[str, Any]] = attrs.field(
        factory=lambda: collections.deque(maxlen=BATCH_LOG_LIMIT)
    )
    refused: int = 0  # configurations the engine refused before them (redrawn)
    coverage: Optional[CoverageTally] = None  # the code under test's, when the workers measure it


class Supervisor:
    """One campaign in progress on ``target`` (:class:`~kvfuzz.campaign.protocol.CampaignTarget`); :meth:`run`
    returns its :class:`CampaignResult`.

    ``status`` receives the progress line (about every half second), ``event`` one line per new failure and per
    dead worker. Constructing it takes the corpus's lock (:class:`~kvfuzz.campaign.lock.CorpusInUse` when another
    campaign holds it); :meth:`run` releases it."""

    def __init__(
        self,
        target: CampaignTarget,
        status: Optional[Callable[[str], None]] = None,
        event: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.target = target
        self.settings = settings = target.settings
        self.status = status or (lambda line: None)
        self.event = event or (lambda line: None)
        self.context = multiprocessing.get_context("fork")
        self.queue = Channel(self.context)
        self.stop = Flag(self.context)  # stop searching
        self.halt = Flag(self.context)  # stop shrinking too (Ctrl-C)
        self.budget: Any = self.context.Value("q", settings.max_examples if settings.max_examples else -1)
        self.tally = _Tally()
        self.slots: dict[int, _Slot] = {}
        self.started = time.monotonic()
        self.ended_by: Optional[str] = None
        self.signal: Optional[int] = None  # the signal that ended the campaign (SIGINT, SIGTERM, SIGHUP), if one did
        self.state = settings.corpus / STATE_DIRECTORY
        self.lock = CorpusLock(self.state, settings.corpus)
        self.lock.acquire()
        self.claims = Path(tempfile.mkdtemp(prefix="claims-", dir=self._state_dir()))
        self.store = open_store(settings.database, self.claims)
        # with Redis: where a dead worker's finding is stored for every machine, as the workers store theirs
        self.cluster = ClusterFindings(settings.database) if is_redis(settings.database) else None
        self.known = KnownFindings()  # set by the target's prepare
        self.recovered: dict[int, Path] = {}  # pid -> the trace its journal became, until that death is handled

    def _state_dir(self) -> Path:
        self.state.mkdir(parents=True, exist_ok=True)
        return self.state

    @property
    def patience(self) -> float:
        """Seconds without a word from a worker before it is taken for hung in C code the watchdog cannot interrupt."""
        return patience_of(self.settings.call_timeout)

    def run(self) -> CampaignResult:
        """Run to the end. Ctrl-C, SIGTERM and SIGHUP are recorded, never raised, while it runs (a message read cut
        short would lose a message): the loop ends the campaign on the first, within a tenth of a second. A harness
        error (kvfuzz's own code failing, in the known findings' replays or in a worker) ends it at once."""
        try:
            with deferred_interrupts() as received:
                self._run(received)
        finally:
            self.lock.release()
        self.status(self.progress_line())
        if self.ended_by is None:
            self.ended_by = "max-examples"
        findings = [self.tally.findings[key] for key in self.tally.order]
        findings += [finding for finding in self.tally.findings.values() if not finding.new]
        return CampaignResult(
            workers=self.settings.workers,
            seconds=time.monotonic() - self.started,
            examples=self.tally.examples,
            steps=self.tally.steps,
            ended_by=self.ended_by,
            findings=tuple(findings),
            dead_workers=tuple(self.tally.dead),
            errors=tuple(self.tally.errors),
            corpus=str(self.settings.corpus),
            rerun=self.target.rerun(),
            batches=self.tally.batches,
            refused=self.tally.refused,
            batch_log=tuple(self.tally.batch_log),
            per_worker=tuple(
                {"worker": number, "examples": slot.examples, "steps": slot.steps, "replaced": slot.incarnation}
                for number, slot in sorted(self.slots.items())
            ),
            **self.target.result_fields(),
            pins=self.settings.pins,
            coverage=self.tally.coverage.result() if self.tally.coverage is not None else None,
        )

    def _run(self, received: list[int]) -> None:
        try:
            self.known = self.target.prepare(self.event)
        except HarnessError as error:
            self._harness(error.describe())
            return
        for recovered in journals.recover(self.settings.corpus):
            death = None if recovered.trace is None else Death.of(recovered.trace, recovered.pid)
            if death is None:
                self.event(f"kvfuzz: {recovered.message}")  # why that program is lost
            else:
                self._recovered(death)
        self.started = time.monotonic()
        if not received:
            for number in range(self.settings.workers):
                self._start(number, 0)
        last_status = 0.0
        try:
            while True:
                if received and self.signal is None:
                    self._interrupted(received[0])
                self._drain(timeout=0.1)
                self._check_end()
                self._check_workers()
                if time.monotonic() - last_status >= 0.5:
                    self.status(self.progress_line())
                    last_status = time.monotonic()
                if self.stop.is_set() and all(slot.done for slot in self.slots.values()):
                    break
        finally:
            for slot in self.slots.values():
                if slot.process.is_alive():
                    slot.process.kill()
                slot.process.join(timeout=5)
            self._drain(timeout=0)
            with contextlib.suppress(OSError):
                for claim in self.claims.iterdir():
                    claim.unlink()
                self.claims.rmdir()

    def _interrupted(self, signum: int) -> None:
        """The user (or their CI) asked the campaign to stop: the workers stop searching, and a shrink in progress
        stops now and saves its program as far as it got."""
        self.signal = signum
        self.ended_by = "interrupted"
        self.stop.set()
        self.halt.set()
        self.event(f"kvfuzz: {signal.Signals(signum).name}: stopping; saving what the workers hold")

    def _harness(self, description: str) -> None:
        """kvfuzz's own code failed driving the engine: every worker stops now (a harness error is never a
        finding, and the next batch would fail the same way)."""
        self.tally.errors.append(description)
        if self.ended_by in (None, "duration", "max-examples", "stop-after"):
            self.ended_by = "harness error"
        self.stop.set()
        self.halt.set()

    # -- workers -------------------------------------------------------------------------------------------------

    def _start(self, slot: int, incarnation: int) -> None:
        settings = self.settings
        ends = None if settings.duration is None else self.started + settings.duration
        args = (
            self.target,
            slot,
            incarnation,
            self.target.seed_of(slot, incarnation),
            self.known,
            self.queue,
            self.stop,
            self.halt,
            self.budget,
            self.state,
            self.claims,
            os.getpid(),
            ends,
        )
        # not a daemon: a scheduler worker's isolated batches are its children (the lifeline, and the kill on the
        # way out of run, keep a worker from outliving its campaign)
        process = self.context.Process(target=worker_main, args=args, daemon=False)
        process.start()
        previous = self.slots.get(slot)
        self.slots[slot] = _Slot(
            process,
            incarnation,
            time.monotonic(),
            examples=previous.examples if previous is not None else 0,
            steps=previous.steps if previous is not None else 0,
        )

    def _check_workers(self) -> None:
        now = time.monotonic()
        for number, slot in list(self.slots.items()):
            if slot.done:
                continue
            if slot.process.exitcode is None and now - slot.last_heard > self.patience:
                slot.process.kill()
                slot.process.join(timeout=5)
                self._died(number, slot, f"hung: no progress for {self.patience:.0f} s, killed")
            elif slot.process.exitcode is not None:
                self._drain(timeout=0)  # its last messages first (a Done that crossed the exit)
                if not slot.done:
                    code = slot.process.exitcode
                    how = f"killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exited ({code})"
                    self._died(number, slot, how)

    def _died(self, number: int, slot: _Slot, how: str) -> None:
        """A worker died: the program it was running (its journal's) becomes a trace, counted as a finding; a new
        worker takes its slot unless the campaign is ending."""
        pid = slot.process.pid
        slot.done = True
        self.tally.shrinking.pop(number, None)
        key: Optional[str] = None
        death = self._journal_of(pid)
        trace_path = None if death is None else str(death.path)
        if death is not None:
            note = f"a worker {how}: not shrunk (every replay kills the process); kvfuzz replay runs it in a child"
            key = self._death_finding(death, note, self.target.seed_of(number, slot.incarnation))
            finding = self.tally.findings.get(key)
            if finding is not None and finding.trace is not None:
                trace_path = finding.trace  # the same death saved once: this worker's copy was dropped
        self.tally.dead.append(DeadWorker(number, pid, how, trace_path, key))
        self.event(f"worker {number} (pid {pid}) {how}; its program: {trace_path or 'lost (no journal)'}; replaced")
        if not self.stop.is_set():
            self._start(number, slot.incarnation + 1)

    def _journal_of(self, pid: int) -> Optional[Death]:
        """The dead worker's journal, as a trace: every journal of a dead process is recovered at once, so another
        worker's death may have recovered this one's first (two deaths between two checks)."""
        if journal_path(self.settings.corpus, pid).exists():
            for recovered in journals.recover(self.settings.corpus):
                if recovered.trace is not None:
                    self.recovered[recovered.pid] = recovered.trace
                else:
                    self.event(f"kvfuzz: {recovered.message}")  # why that death's program is lost
        path = self.recovered.pop(pid, None)
        return None if path is None else Death.of(path, pid)

    def _recovered(self, death: Death) -> None:
        """The program of a process that died before this campaign started (its journal recovered), as a finding of
        this campaign: its supervisor, killed too, never reported it."""
        who = "a process" if death.pid is None else f"a process (pid {death.pid})"
        note = (
            f"recovered at the campaign's start from the journal of {who} that died before it: not shrunk (every "
            "replay kills the process); kvfuzz replay runs it in a child"
        )
        key = self._death_finding(death, note, None)
        where = death.path if death.path.exists() else f"{self.tally.findings[key].text}, met before (not kept twice)"
        self.event(f"kvfuzz: recovered the program {who} that died was running: {where}")

    def _death_finding(self, death: Death, note: str, seed: Optional[int]) -> str:
        """A dead process's program (``seed``: that worker's seed stream, None: not this campaign's worker), as a
        finding: counted when its signature is known or claimed elsewhere, else claimed, kept (``note`` saying how
        it died), and stored in Redis when there is one."""
        path, trace, signature = death.path, death.trace, death.signature
        key = signature.key()
        if key in self.tally.findings or key in self.known:
            self._seen(signature.to_json(), key, self.known.where().get(key, "met earlier in this campaign"))
            with contextlib.suppress(OSError):
                if key in self.known or self.tally.findings[key].trace != str(path):
                    path.unlink()  # the same death is already saved once
            return key
        where = judge(self.store, self.known, signature, None, {"signature": signature.to_json(), "trace": str(path)})
        if where is not None:  # claimed first by another campaign sharing the store
            self._seen(signature.to_json(), key, where)
            return key
        noted = self.known.noted(key, None, note)
        shared = self.cluster.share(trace, signature, self.settings.seed, seed, str(path)) if self.cluster else None
        noted = shared.noted(noted) if shared is not None else noted
        self.tally.findings[key] = Finding(
            signature.to_json(),
            self.target.text(signature.to_json()),
            True,
            1,
            time.monotonic() - self.started,
            self.tally.examples,
            program_length=len(trace.program),
            shrunk_length=len(trace.program),
            trace=str(path),
            note=noted,
            explanation=death.explanation,
        )
        self.tally.order.append(key)
        return key

    # -- messages ------------------------------------------------------------------------------------------------

    def _drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            message = self.queue.get(max(0.0, deadline - time.monotonic()))
            if message is None:
                return
            self._handle(message)

    def _handle(self, message: Message) -> None:
        slot = self.slots.get(message.worker)
        if slot is not None:
            slot.last_heard = time.monotonic()
        if isinstance(message, Progress):
            self.tally.examples += message.examples
            self.tally.steps += message.steps
            if slot is not None:
                slot.phase = message.phase
                slot.examples += message.examples
                slot.steps += message.steps
        elif isinstance(message, Claimed):
            self.tally.findings[message.key] = Finding(
                message.signature,
                self.target.text(message.signature),
                True,
                1,
                time.monotonic() - self.started,
                self.tally.examples,
                program_length=message.program_length,
                trace=message.trace,
            )
            self.tally.order.append(message.key)
            self.tally.shrinking[message.worker] = message.key
            self.event(
                f"new failure: {self.target.text(message.signature)} (shrinking {message.program_length} "
                f"{'calls' if message.trace is None else 'operations; as found: ' + message.trace})"
            )
            if self.settings.stop_after is not None and len(self.tally.order) >= self.settings.stop_after:
                self._end("stop-after")
        elif isinstance(message, Saved):
            self._saved(message)
        elif isinstance(message, Seen):
            self._seen(message.signature, message.key, message.known)
        elif isinstance(message, Batch):
            self.tally.batches += 1
            self.tally.batch_log.append({**message.entry, "worker": message.worker})
            self.tally.refused += message.refused
        elif isinstance(message, Covered):
            if self.tally.coverage is None:
                self.tally.coverage = CoverageTally()
            self.tally.coverage.add(message, self.elapsed())
        elif isinstance(message, Said):
            self.event(message.line)
        elif isinstance(message, Done):
            if slot is not None:
                slot.done = True
        elif isinstance(message, HarnessFailed):
            self._harness(message.description)
            if slot is not None:
                slot.done = True
        elif isinstance(message, Crashed):
            self.tally.errors.append(message.traceback)
            if slot is not None:
                slot.done = True
            if all(slot.done for slot in self.slots.values()):
                self._end("workers failed")

    def _saved(self, message: Saved) -> None:
        self.tally.shrinking.pop(message.worker, None)
        finding = self.tally.findings[message.key]
        self.tally.findings[message.key] = attrs.evolve(
            finding,
            shrunk_length=message.shrunk_length,
            trace=message.trace,
            note=message.note,
            reproduced=message.reproduced,
            replays=message.replays,
            program=message.program,
            explanation=message.explanation,
            unsaved_trace=message.unsaved_trace,
        )
        what = "calls" if finding.signature.get("operation") is not None else "operations"
        where = message.trace or "NOT SAVED (the trace is in the result)"
        self.event(f"  shrunk to {message.shrunk_length} {what}: {where}")
        if message.trace:
            self.event(f"  {show_hint(Path(message.trace), finding.signature.get('allocator'))}")

    def _seen(self, signature: dict[str, Optional[str]], key: str, known: str) -> None:
        finding = self.tally.findings.get(key)
        if finding is None:
            self.tally.findings[key] = Finding(
                signature,
                self.target.text(signature),
                False,
                1,
                time.monotonic() - self.started,
                self.tally.examples,
                known=known,
            )
        else:
            self.tally.findings[key] = attrs.evolve(finding, seen=finding.seen + 1)

    # -- ending --------------------------------------------------------------------------------------------------

    def _end(self, why: str) -> None:
        if self.ended_by is None:
            self.ended_by = why
        self.stop.set()

    def _check_end(self) -> None:
        if self.settings.duration is not None and self.elapsed() >= self.settings.duration:
            self._end("duration")
        if self.stop.is_set() and self.ended_by is None and self.budget.value == 0:
            self.ended_by = "max-examples"

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def progress_line(self) -> str:
        """elapsed (and remaining), examples, steps/s, distinct failures, and the phase."""
        elapsed = self.elapsed()
        clock = _clock(elapsed)
        if self.settings.duration is not None:
            clock += f" of {_clock(self.settings.duration)} ({_clock(max(0.0, self.settings.duration - elapsed))} left)"
        new = len(self.tally.order)
        known = len(self.tally.findings) - new
        shrinking = sorted(self.tally.order.index(key) + 1 for key in self.tally.shrinking.values())
        if shrinking:
            phase = f"shrinking {shrinking[0]} of {new}"
        elif self.stop.is_set():
            phase = "ending"
        else:
            phase = "searching"
        rate = self.tally.steps / elapsed if elapsed else 0.0
        reached = f"  {self.tally.coverage.progress()}" if self.tally.coverage is not None else ""
        return (
            f"{clock}  {self.tally.examples} examples  {rate:.0f} steps/s  "
            f"{new} new distinct failure{'s' if new != 1 else ''} ({known} known){reached}  {phase}"
        )


def _clock(seconds: float) -> str:
    minutes, second = divmod(int(seconds), 60)
    return f"{minutes}:{second:02d}"


class Campaign(Supervisor):
    """An allocator campaign (:class:`~kvfuzz.campaign.allocators.AllocatorCampaign` under the supervisor)."""

    def __init__(
        self,
        options: CampaignOptions,
        status: Optional[Callable[[str], None]] = None,
        event: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.options = options
        super().__init__(AllocatorCampaign(options), status, event)


def run_campaign(
    options: CampaignOptions,
    status: Optional[Callable[[str], None]] = None,
    event: Optional[Callable[[str], None]] = None,
) -> CampaignResult:
    """Run an allocator campaign to its end; see :class:`Supervisor`."""
    return Campaign(options, status, event).run()


def rerun_of(options: CampaignOptions) -> Rerun:
    """The settings of a campaign run with ``options`` in this directory, by this kvfuzz: how to run it again."""
    return AllocatorCampaign(options).rerun()
