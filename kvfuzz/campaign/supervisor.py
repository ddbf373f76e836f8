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

import contextlib
import hashlib
import multiprocessing
import os
import queue as queue_module
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import attrs

import kvfuzz
from kvfuzz.campaign.cluster import ClusterFindings, finding_record, is_redis
from kvfuzz.campaign.known import known_signatures, stored_findings_known
from kvfuzz.campaign.lock import CorpusLock
from kvfuzz.campaign.messages import Claimed, Crashed, Done, Message, Progress, Saved, Seen
from kvfuzz.campaign.report import CampaignResult, DeadWorker, Finding
from kvfuzz.campaign.rerun import Rerun
from kvfuzz.campaign.store import open_store
from kvfuzz.campaign.swarm import Limits
from kvfuzz.campaign.worker import HYPOTHESIS_EVERY, WorkerPlan, patience_of, worker_main
from kvfuzz.engine.config import MachineConfig
from kvfuzz.program.safeguards import DEFAULT_CALL_TIMEOUT, deferred_interrupts, journal_path
from kvfuzz.saved import journals
from kvfuzz.saved.corpus import PROCESS_DIED
from kvfuzz.saved.hint import show_hint
from kvfuzz.saved.trace import TraceError, load
from kvfuzz.shrink.signature import TEARDOWN, Signature

DEFAULT_DURATION = 600.0
"""Seconds a campaign runs unless told otherwise (``kvfuzz campaign``, the plugin's nightly profile)."""

STATE_DIRECTORY = ".kvfuzz-campaign"
"""Inside the corpus: the local example database and the workers' signature claims (hidden: never collected)."""


@attrs.frozen
class CampaignOptions:
    """What one campaign runs: the allocators (each probed into :class:`Limits`), how many workers, when it ends,
    where it saves, and what it shares."""

    allocators: tuple[str, ...]  # specs
    limits: tuple[Limits, ...]  # one per allocator, in the same order
    workers: int
    corpus: Path  # where new traces are saved (and the workers' journals kept)
    duration: Optional[float] = None  # seconds; None: no limit
    max_examples: Optional[int] = None  # programs to start, all workers together; None: no limit
    stop_after: Optional[int] = None  # new distinct failures; None: no limit
    known: tuple[Path, ...] = ()  # corpus directories whose traces' signatures are known findings
    database: Optional[str] = None  # redis://host:port/N, or an example-database directory
    seed: int = 0  # the campaign's seed: each worker's stream derives from it
    call_timeout: Optional[float] = DEFAULT_CALL_TIMEOUT
    shrink_seconds: float = 30.0
    base: MachineConfig = MachineConfig()  # model shape and kernel; the geometry is swarmed
    hypothesis_every: int = HYPOTHESIS_EVERY


def worker_seed(seed: int, slot: int, incarnation: int) -> int:
    """The seed stream of one worker: distinct for each slot and each replacement of a dead worker."""
    digest = hashlib.sha256(f"{seed}/{slot}/{incarnation}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


@attrs.define
class _Slot:
    """One worker slot: the process running in it now and what the campaign last heard from it."""

    process: Any  # multiprocessing.Process
    incarnation: int
    last_heard: float
    phase: str = "searching"
    done: bool = False


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


class Campaign:
    """One campaign in progress; :meth:`run` returns its :class:`CampaignResult`.

    ``status`` receives the progress line (about every half second), ``event`` one line per new failure and per
    dead worker. Constructing it takes the corpus's lock (:class:`~kvfuzz.campaign.lock.CorpusInUse` when another
    campaign holds it); :meth:`run` releases it."""

    def __init__(
        self,
        options: CampaignOptions,
        status: Optional[Callable[[str], None]] = None,
        event: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.options = options
        self.status = status or (lambda line: None)
        self.event = event or (lambda line: None)
        self.context = multiprocessing.get_context("fork")
        self.queue: Any = self.context.Queue()
        self.stop = self.context.Event()  # stop searching
        self.halt = self.context.Event()  # stop shrinking too (Ctrl-C)
        self.budget: Any = self.context.Value("q", options.max_examples if options.max_examples else -1)
        self.tally = _Tally()
        self.slots: dict[int, _Slot] = {}
        self.started = time.monotonic()
        self.ended_by: Optional[str] = None
        self.signal: Optional[int] = None  # the signal that ended the campaign (SIGINT, SIGTERM, SIGHUP), if one did
        self.state = options.corpus / STATE_DIRECTORY
        self.lock = CorpusLock(self.state, options.corpus)
        self.lock.acquire()
        self.claims = Path(tempfile.mkdtemp(prefix="claims-", dir=self._state_dir()))
        self.store = open_store(options.database, self.claims)
        # with Redis: where a dead worker's finding is stored for every machine, as the workers store theirs
        self.cluster = ClusterFindings(options.database) if is_redis(options.database) else None
        self.known: dict[str, str] = {}
        self.recovered: dict[int, str] = {}  # pid -> trace its journal became, until that death is handled

    def _state_dir(self) -> Path:
        self.state.mkdir(parents=True, exist_ok=True)
        return self.state

    @property
    def patience(self) -> float:
        """Seconds without a word from a worker before it is taken for hung in C code the watchdog cannot interrupt."""
        return patience_of(self.options.call_timeout)

    def run(self) -> CampaignResult:
        """Run to the end. Ctrl-C, SIGTERM and SIGHUP are recorded, never raised, while it runs (a queue read cut
        short would lose a message): the loop ends the campaign on the first, within a tenth of a second."""
        options = self.options
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
            options.allocators,
            options.workers,
            time.monotonic() - self.started,
            self.tally.examples,
            self.tally.steps,
            self.ended_by,
            tuple(findings),
            tuple(self.tally.dead),
            tuple(self.tally.errors),
            str(options.corpus),
            rerun_of(options),
        )

    def _run(self, received: list[int]) -> None:
        options = self.options
        for recovered in journals.recover(options.corpus):
            self.event(f"kvfuzz: {recovered.message}")
        self.known = known_signatures(
            [*options.known, options.corpus], options.allocators, options.call_timeout or 60.0
        )
        if self.cluster is not None:  # findings stored under an earlier signature's key: known under today's
            stale = stored_findings_known(self.cluster, options.allocators, options.call_timeout or 60.0)
            self.known = {**stale, **self.known}
        self.started = time.monotonic()
        if not received:
            for number in range(options.workers):
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

    # -- workers -------------------------------------------------------------------------------------------------

    def _start(self, slot: int, incarnation: int) -> None:
        options = self.options
        plan = WorkerPlan(
            slot,
            worker_seed(options.seed, slot, incarnation),
            options.allocators,
            options.limits,
            options.base,
            options.corpus,
            options.database,
            self.state,
            self.known,
            options.call_timeout,
            options.shrink_seconds,
            options.hypothesis_every,
            self.claims,
            os.getpid(),
            options.seed,
        )
        process = self.context.Process(
            target=worker_main, args=(plan, self.queue, self.stop, self.halt, self.budget), daemon=True
        )
        process.start()
        self.slots[slot] = _Slot(process, incarnation, time.monotonic())

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
        """A worker died: its journal becomes a trace (the program it was running), counted as a finding; a new
        worker takes its slot unless the campaign is ending."""
        pid = slot.process.pid
        slot.done = True
        self.tally.shrinking.pop(number, None)
        key: Optional[str] = None
        if journal_path(self.options.corpus, pid).exists():
            for recovered in journals.recover(self.options.corpus):
                if recovered.trace is not None:
                    self.recovered[recovered.pid] = str(recovered.trace)
                else:
                    self.event(f"kvfuzz: {recovered.message}")  # why that death's program is lost
        # Another worker's death may have recovered this one's journal first (two deaths between two checks).
        trace_path = self.recovered.pop(pid, None)
        if trace_path is not None:
            key = self._death_finding(Path(trace_path), how, worker_seed(self.options.seed, number, slot.incarnation))
            finding = self.tally.findings.get(key) if key is not None else None
            if finding is not None and finding.trace is not None:
                trace_path = finding.trace  # the same death saved once: this worker's copy was dropped
        self.tally.dead.append(DeadWorker(number, pid, how, trace_path, key))
        self.event(f"worker {number} (pid {pid}) {how}; its program: {trace_path or 'lost (no journal)'}; replaced")
        if not self.stop.is_set():
            self._start(number, slot.incarnation + 1)

    def _death_finding(self, path: Path, how: str, seed: int) -> Optional[str]:
        """The trace a dead worker's journal became, as a finding (``seed``: that worker's seed stream): counted when
        its signature is known or claimed elsewhere, else claimed, kept, and stored in Redis when there is one."""
        try:
            trace = load(path)
        except TraceError:
            return None
        operation = trace.program[-1].rule if trace.program else TEARDOWN
        signature = Signature(trace.allocator, PROCESS_DIED, operation)
        key = signature.key()
        if key in self.tally.findings or key in self.known:
            self._seen(signature.to_json(), key, self.known.get(key, "met earlier in this campaign"))
            with contextlib.suppress(OSError):
                if key in self.known or self.tally.findings[key].trace != str(path):
                    path.unlink()  # the same death is already saved once
            return key
        prior = self.store.claim(signature, {"signature": signature.to_json(), "trace": str(path)})
        if prior is not None:
            self._seen(signature.to_json(), key, f"found earlier by {prior.get('found_by', 'another campaign')}")
            return key
        note = f"a worker {how}: not shrunk (every replay kills the process); kvfuzz replay runs it in a child"
        if self.cluster is not None:
            try:
                self.cluster.store(key, finding_record(trace, signature, self.options.seed, seed, str(path)))
            except Exception as error:  # noqa: BLE001 -- the server went away: the local trace still stands
                note += f"; not stored in Redis ({' '.join(str(error).split())})"
        self.tally.findings[key] = Finding(
            signature.to_json(),
            self._text(signature.to_json()),
            True,
            1,
            time.monotonic() - self.started,
            self.tally.examples,
            program_length=len(trace.program),
            shrunk_length=len(trace.program),
            trace=str(path),
            note=note,
            explanation=str(trace.failure.get("explanation", "")),
        )
        self.tally.order.append(key)
        return key

    # -- messages ------------------------------------------------------------------------------------------------

    def _drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                wait = max(0.0, deadline - time.monotonic())
                message: Message = self.queue.get(timeout=wait) if wait else self.queue.get_nowait()
            except queue_module.Empty:
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
        elif isinstance(message, Claimed):
            self.tally.findings[message.key] = Finding(
                message.signature,
                self._text(message.signature),
                True,
                1,
                time.monotonic() - self.started,
                self.tally.examples,
                program_length=message.program_length,
            )
            self.tally.order.append(message.key)
            self.tally.shrinking[message.worker] = message.key
            self.event(f"new failure: {self._text(message.signature)} (shrinking {message.program_length} calls)")
            if self.options.stop_after is not None and len(self.tally.order) >= self.options.stop_after:
                self._end("stop-after")
        elif isinstance(message, Saved):
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
            where = message.trace or "NOT SAVED (the trace is in the result)"
            self.event(f"  shrunk to {message.shrunk_length} calls: {where}")
            if message.trace:
                self.event(f"  {show_hint(Path(message.trace), finding.signature.get('allocator'))}")
        elif isinstance(message, Seen):
            self._seen(message.signature, message.key, message.known)
        elif isinstance(message, Done):
            if slot is not None:
                slot.done = True
        elif isinstance(message, Crashed):
            self.tally.errors.append(message.traceback)
            if slot is not None:
                slot.done = True
            if all(slot.done for slot in self.slots.values()):
                self._end("workers failed")

    def _seen(self, signature: dict[str, Optional[str]], key: str, known: str) -> None:
        finding = self.tally.findings.get(key)
        if finding is None:
            self.tally.findings[key] = Finding(
                signature,
                self._text(signature),
                False,
                1,
                time.monotonic() - self.started,
                self.tally.examples,
                known=known,
            )
        else:
            self.tally.findings[key] = attrs.evolve(finding, seen=finding.seen + 1)

    def _text(self, signature: dict[str, Optional[str]]) -> str:
        text = str(Signature(**signature))  # type: ignore[arg-type]  # Signature.to_json()'s fields
        return f"{text} [{signature['allocator']}]" if len(self.options.allocators) > 1 else text

    # -- ending --------------------------------------------------------------------------------------------------

    def _end(self, why: str) -> None:
        if self.ended_by is None:
            self.ended_by = why
        self.stop.set()

    def _check_end(self) -> None:
        if self.options.duration is not None and self.elapsed() >= self.options.duration:
            self._end("duration")
        if self.stop.is_set() and self.ended_by is None and self.budget.value == 0:
            self.ended_by = "max-examples"

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def progress_line(self) -> str:
        """elapsed (and remaining), examples, steps/s, distinct failures, and the phase."""
        elapsed = self.elapsed()
        clock = _clock(elapsed)
        if self.options.duration is not None:
            clock += f" of {_clock(self.options.duration)} ({_clock(max(0.0, self.options.duration - elapsed))} left)"
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
        return (
            f"{clock}  {self.tally.examples} examples  {rate:.0f} steps/s  "
            f"{new} new distinct failure{'s' if new != 1 else ''} ({known} known)  {phase}"
        )


def _clock(seconds: float) -> str:
    minutes, second = divmod(int(seconds), 60)
    return f"{minutes}:{second:02d}"


def run_campaign(
    options: CampaignOptions,
    status: Optional[Callable[[str], None]] = None,
    event: Optional[Callable[[str], None]] = None,
) -> CampaignResult:
    """Run a campaign to its end; see :class:`Campaign`."""
    return Campaign(options, status, event).run()


def rerun_of(options: CampaignOptions) -> Rerun:
    """The settings of a campaign run with ``options`` in this directory, by this kvfuzz: how to run it again."""
    return Rerun(
        options.allocators,
        options.seed,
        options.workers,
        options.duration,
        options.max_examples,
        options.stop_after,
        str(options.corpus),
        tuple(map(str, options.known)),
        options.database,
        options.shrink_seconds,
        options.call_timeout,
        os.getcwd(),
        kvfuzz.__version__,
    )
