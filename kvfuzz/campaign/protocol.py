"""What a campaign asks of its target: the one supervisor (:mod:`kvfuzz.campaign.supervisor`) runs the workers, merges
their findings into one table, recovers the programs of dead processes from their journals (one journal, one
recovery, for every target: :class:`Death`), replaces dead workers and ends the campaign; a target contributes only
what is its own. The allocator target is :mod:`kvfuzz.campaign.allocators`; the scheduler targets (vLLM's, SGLang's) are
:mod:`kvfuzz.campaign.scheduler.workers`.

A target's worker runs in a process forked from the supervisor after :meth:`CampaignTarget.prepare` (so it inherits
what ``prepare`` computed, an engine already imported among it), and speaks to the supervisor only through
:class:`WorkerContext` (its :class:`Reporter`): progress and each failure met, as
:mod:`~kvfuzz.campaign.messages`. What a failure is saved as, how it is shrunk and what makes two failures one
finding are the target's; that a finding is claimed once across every worker (and every machine sharing a Redis),
counted when known, and saved before it is shrunk, is every target's contract.
"""

from __future__ import annotations

import hashlib
import time
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import attrs

from kvfuzz.campaign.flag import Flag
from kvfuzz.campaign.known import KnownFindings
from kvfuzz.campaign.messages import Message, Progress
from kvfuzz.campaign.settings import Settings
from kvfuzz.saved.corpus import died_signature
from kvfuzz.saved.trace import Trace, TraceError, load
from kvfuzz.scheduler.trace import PROCESS_DIED as SCHEDULER_DIED
from kvfuzz.scheduler.trace import SchedulerTrace, SchedulerTraceError
from kvfuzz.scheduler.trace import load as load_scheduler_trace
from kvfuzz.shrink.signature import Signature
from kvfuzz.trace_files import json_file_kind

if TYPE_CHECKING:
    from kvfuzz.campaign.rerun import Rerun


def worker_seed(seed: int, slot: int, incarnation: int) -> int:
    """A seed stream for one worker: distinct for each slot and each replacement of a dead worker."""
    digest = hashlib.sha256(f"{seed}/{slot}/{incarnation}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


@attrs.frozen
class Death:
    """The program a dead process was running, recovered from its journal as a trace of its target
    (:mod:`kvfuzz.saved.journals`): what the supervisor makes a finding of."""

    path: Path  # where the trace is saved
    trace: Trace | SchedulerTrace
    signature: Signature
    explanation: str  # the trace's explanation of the death, for a person
    pid: Optional[int] = None  # the process that died

    @classmethod
    def of(cls, path: Path, pid: Optional[int] = None) -> Optional[Death]:
        """The death the trace a journal became at ``path`` records, of either target (None: it cannot be read
        back). Its signature: the allocator's, the process died in the last call's operation; a scheduler's, a
        crash of :data:`~kvfuzz.scheduler.trace.PROCESS_DIED` (as a known trace of it reproduces)."""
        try:
            if json_file_kind(path) == "scheduler-trace":
                scheduler = load_scheduler_trace(path)
                died = Signature(scheduler.scheduler, f"crash ({SCHEDULER_DIED})", None)
                return cls(path, scheduler, died, scheduler.failure.describe(), pid)
            trace = load(path)
        except (TraceError, SchedulerTraceError):
            return None
        return cls(path, trace, died_signature(trace), str(trace.failure.get("explanation", "")), pid)


class Sink(Protocol):
    """Where a worker's messages go."""

    def put(self, message: Message) -> None: ...


class Channel:
    """The workers' messages to the supervisor: one pipe, each message written whole under a lock, at once, by the
    worker's own thread (never a background thread's buffer, as a ``multiprocessing.Queue``'s): a message sent
    (a claim naming the trace saved as found, say) has reached the pipe before the worker goes on, so a worker killed
    the moment after loses none of it."""

    def __init__(self, context: Any) -> None:
        self.receiving, self.sending = context.Pipe(duplex=False)
        self.lock = context.Lock()

    def put(self, message: Message) -> None:
        with self.lock:
            self.sending.send(message)

    def get(self, timeout: float) -> Optional[Message]:
        """The next message, waiting at most ``timeout`` seconds for it (None: none came)."""
        receiving: Connection = self.receiving
        if not receiving.poll(timeout):
            return None
        message: Message = receiving.recv()
        return message


class Reporter:
    """Sends progress to the campaign at most every ``interval`` seconds (also a heartbeat), and each message."""

    def __init__(self, queue: Sink, slot: int, interval: float = 0.25) -> None:
        self.queue, self.slot, self.interval = queue, slot, interval
        self.examples = self.steps = 0
        self.phase = "searching"
        self.last = time.monotonic()

    def on_step(self, stats: object) -> None:
        self.steps += 1
        self.beat()

    def beat(self) -> None:
        """Alive: progress (or a heartbeat) goes out if the last went ``interval`` ago."""
        if time.monotonic() - self.last >= self.interval:
            self.flush()

    def example(self) -> None:
        self.examples += 1

    def flush(self) -> None:
        self.queue.put(Progress(self.slot, self.examples, self.steps, self.phase))
        self.examples = self.steps = 0
        self.last = time.monotonic()

    def send(self, message: Message) -> None:
        self.flush()
        self.queue.put(message)


@attrs.frozen
class WorkerContext:
    """What one worker has of its campaign, fixed when it starts (but for the shared events and budget)."""

    slot: int  # the worker's slot, 0 .. workers - 1
    incarnation: int  # 0, then one more for each replacement of a dead worker in this slot
    seed: int  # its own seed stream (differs per slot and per replacement)
    reporter: Reporter
    stop: Flag  # set by the campaign when it ends
    halt: Flag  # set on Ctrl-C: shrinks end early too
    budget: "Synchronized[int]"  # examples left to start, shared by every worker; negative: no limit
    known: KnownFindings  # the signatures the corpus knows (counted when met) and its regressions (reported)
    state: Path  # the campaign's local state (example database; the claims without Redis)
    claims: Path  # without Redis: the campaign's directory of signature claims
    supervisor: Optional[int] = None  # the campaign's pid, recorded with findings; None: not a campaign's process
    ends: Optional[float] = None  # time.monotonic() at which the campaign's duration is up; None: no duration

    def take_examples(self, wanted: int) -> int:
        """How many of ``wanted`` examples the campaign's budget still allows (they are counted now); 0 once the
        budget is spent, which ends the search."""
        with self.budget.get_lock():
            if self.budget.value < 0:
                return wanted
            granted = min(wanted, self.budget.value)
            self.budget.value -= granted
        if not granted:
            self.stop.set()
        return granted

    def settle_examples(self, granted: int, ran: int) -> None:
        """``granted`` examples were taken and ``ran`` were run: the difference goes back to the budget (or, for
        more run than granted, comes off it, never below 0)."""
        with self.budget.get_lock():
            if self.budget.value >= 0:
                self.budget.value = max(0, self.budget.value + granted - ran)


class CampaignTarget(Protocol):
    """One kind of target a campaign searches (see the module)."""

    settings: Settings

    def prepare(self, event: Callable[[str], None]) -> KnownFindings:
        """Before any worker starts, in the supervisor: the known findings (:mod:`kvfuzz.campaign.known`, from the
        target's source). Raises :class:`~kvfuzz.scheduler.harness.HarnessError` when kvfuzz's own code fails (the
        campaign ends on it)."""
        ...

    def seed_of(self, slot: int, incarnation: int) -> int:
        """The seed stream of the worker in ``slot`` (its ``incarnation``-th replacement): a different one for
        each, derived from the campaign's seed alone (:func:`worker_seed`)."""
        ...

    def search(self, worker: WorkerContext) -> None:
        """In the worker process: search until ``worker.stop`` is set or the example budget is spent, reporting
        progress and every failure through ``worker``."""
        ...

    def text(self, signature: dict[str, Optional[str]]) -> str:
        """A finding's signature, for a person."""
        ...

    def rerun(self) -> Rerun:
        """The settings the campaign runs under: how to run it again."""
        ...

    def result_fields(self) -> dict[str, Any]:
        """The target's own fields of :class:`~kvfuzz.campaign.report.CampaignResult` (its allocators, or its
        scheduler)."""
        ...
