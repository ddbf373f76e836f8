"""The search over one scheduler configuration: the Hypothesis machine run for a number of examples (derandomized,
so the same run every time), its failure shrunk by Hypothesis to the fewest requests and steps, and the outcome."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Optional

import attrs
from hypothesis.database import ExampleDatabase

from kvfuzz.hypothesis_search import Searched, search_machine
from kvfuzz.profiles import run_settings
from kvfuzz.program.safeguards import Journal, OutsideStop, Watchdog
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.crash import crash_message
from kvfuzz.scheduler.harness import HarnessError
from kvfuzz.scheduler.machine import Tally, Witness, machine_for_setup
from kvfuzz.scheduler.offloading import TransferTally
from kvfuzz.scheduler.program import Operation, program_source
from kvfuzz.scheduler.session import Session, WorkerFactory
from kvfuzz.scheduler.violations import SchedulerViolation
from kvfuzz.scheduler.worker import Worker
from kvfuzz.text import plural
from kvfuzz.threads import single_threaded_torch


class SearchCutOff(OutsideStop):
    """Raised into a running search from outside it (a campaign's end, or its stop: an alarm, a signal) to end it
    early: :func:`search` returns what it ran so far (``Outcome.cut_off``), the example it was running abandoned; a
    failure met before is kept."""


@attrs.frozen
class Outcome:
    """What a search found."""

    setup: SchedulerSetup  # the configuration searched
    examples: int  # examples run (shrinking's replays included)
    steps: int  # schedule() calls over all of them
    preemptions: int  # requests the scheduler preempted over all of them
    hit_tokens: int  # tokens new and resumed requests found in the prefix cache
    seconds: float  # the search itself
    failure: Optional[Exception]  # the shrunk failure (a check's SchedulerViolation, or vLLM's own exception), or None
    program: str  # Hypothesis's falsifying example: the calls that reproduce it ("" when passed)
    drafts: int = 0  # speculative drafts scheduled over all examples
    accepted_drafts: int = 0  # of them, accepted
    rewrites: int = 0  # async scheduling: released blocks written while a step that read them was in flight
    transfers: TransferTally = attrs.Factory(TransferTally)  # the KV connector's transfers (all zero without one)
    lora_held_back: int = 0  # LoRA: steps after which the adapter limit held a waiting request back
    harness: Optional[HarnessError] = None  # kvfuzz's own code failed (the search stopped there): no finding
    cut_off: bool = False  # ended early from outside (SearchCutOff): the examples above are those it ran

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0

    def describe(self) -> list[str]:
        verdict = "FAILED" if self.failure is not None else "STOPPED by a harness error" if self.harness else "passed"
        lines = [
            f"{verdict}: {plural(self.examples, 'example')}, {plural(self.steps, 'step')} in {self.seconds:.1f} s "
            f"({self.steps_per_second:.0f} steps/s)",
            f"the scheduler preempted {plural(self.preemptions, 'request')}; "
            f"{plural(self.hit_tokens, 'prompt token')} hit the prefix cache",
        ]
        if self.setup.speculative_tokens:
            lines.append(
                f"{plural(self.drafts, 'speculative draft')} scheduled: {self.accepted_drafts} accepted, "
                f"{self.drafts - self.accepted_drafts} rejected"
            )
        if self.setup.async_scheduling:
            lines.append(
                f"{plural(self.rewrites, 'released block')} written while a step that read it was in flight "
                "(after it, on the stream)"
            )
        if self.setup.kv_connector == "offloading":
            lines.append(self.transfers.describe())
        if self.setup.kv_connector == "pd":
            lines.append(self.transfers.describe_pd())
        if self.setup.max_loras:
            lines.append(
                f"LoRA: the limit of {plural(self.setup.max_loras, 'adapter')} a step held a waiting request of "
                f"another adapter back after {plural(self.lora_held_back, 'step')}"
            )
        if self.failure is not None:
            lines += ["", self.explanation(), "", self.program]
        return lines

    def check(self) -> Optional[str]:
        """The check that failed, ``crash`` for an exception of vLLM's own, or None."""
        if self.failure is None:
            return None
        return self.failure.check.value if isinstance(self.failure, SchedulerViolation) else "crash"

    def explanation(self) -> str:
        if isinstance(self.failure, SchedulerViolation) or self.failure is None:
            return str(self.failure or "")
        return f"crash: {crash_message(self.failure)}"

    def to_json(self) -> dict[str, Any]:
        return {
            "failed": self.failure is not None,
            "examples": self.examples,
            "steps": self.steps,
            "preemptions": self.preemptions,
            "hit_tokens": self.hit_tokens,
            "drafts": self.drafts,
            "accepted_drafts": self.accepted_drafts,
            "released_rewrites": self.rewrites,
            "transfers": attrs.asdict(self.transfers),
            "lora_held_back": self.lora_held_back,
            "seconds": round(self.seconds, 3),
            "steps_per_second": round(self.steps_per_second, 1),
            "check": self.check(),
            "explanation": self.explanation() or None,
            "program": self.program or None,
            "harness_error": self.harness.hint if self.harness is not None else None,
        }


def search_kind(seed: Optional[int], database: Optional[str]) -> str:
    """How a search draws its examples, for a header: a seed, derandomized, or random with an example database."""
    if seed is not None:
        return f"seed {seed}"
    return "derandomized" if database is None else f"random, example database {database}"


class _Shortest:
    """The shortest failing example the machine met (the first of equals): what a search reports when Hypothesis
    cannot, because replaying a failing example drew differently from the first time (Hypothesis's ``Flaky``)."""

    def __init__(self, witness: Optional[Witness]) -> None:
        self.witness = witness  # told of every failing example, as before
        self.program: Optional[tuple[Operation, ...]] = None
        self.failure: Optional[Exception] = None

    def __call__(self, session: Session, error: BaseException) -> None:
        if isinstance(error, Exception) and (self.program is None or len(session.program) < len(self.program)):
            self.program, self.failure = tuple(session.program), error
        if self.witness is not None:
            self.witness(session, error)

    def source(self) -> str:
        """The example's program as the machine's calls, as Hypothesis prints a falsifying example."""
        return program_source(self.program or ())


def search(
    setup: SchedulerSetup,
    examples: int,
    steps: int,
    shrink: bool = True,
    worker: WorkerFactory = Worker,
    witness: Optional[Witness] = None,
    session: Optional[Callable[[], Any]] = None,
    name: str = "VllmV1SchedulerMachine",
    seed: Optional[int] = None,
    call_timeout: Optional[float] = None,
    journal: Optional[Journal] = None,
    database: Optional[ExampleDatabase] = None,
) -> Outcome:
    """Run the machine for ``examples`` examples of up to ``steps`` operations, Hypothesis seeded with ``seed`` (the
    same seed, the same examples; None: derandomized, as ``kvfuzz run`` without ``--seed``); a failure (a
    :class:`SchedulerViolation`, or any exception vLLM raises) is shrunk, unless ``shrink`` is off, and returned.
    ``witness`` is told of every failing example (the first found, shrinking's, and the shrunk one last);
    ``session`` and ``name`` select another engine's session (:func:`machine_for_setup`). A step running past
    ``call_timeout`` seconds is interrupted and fails the hang check (None: no watchdog). ``journal`` keeps each
    example's program on disk as it runs. With ``database`` the search is random (unless seeded) and Hypothesis
    keeps its failing examples there, replaying them first the next time."""
    tally = Tally()
    watchdog = Watchdog(call_timeout) if call_timeout is not None else None
    shortest = _Shortest(witness)
    machine = machine_for_setup(setup, worker, tally, shortest, session, name, watchdog, journal)
    drawn = run_settings(examples, steps, derandomize=database is None, shrink=shrink, database=database)
    failure: Optional[Exception] = None
    harness: Optional[HarnessError] = None
    program = ""
    started = time.perf_counter()
    try:
        with single_threaded_torch(), watchdog or contextlib.nullcontext():
            searched = search_machine(machine, drawn, seed=seed, cut_offs=(SearchCutOff,))
    except HarnessError as error:  # kvfuzz's own code failed: the search stops, nothing is a finding
        searched = Searched()
        harness = error
    cut_off = searched.cut_off
    if searched.flaky is not None and shortest.failure is not None:  # replaying a failing example drew or failed
        failure, program = shortest.failure, shortest.source()  # differently: the shortest one met, not shrunk further
        program += (
            f"\n# not shrunk further: Hypothesis's replay of a failing example went differently ({searched.flaky!r})"
        )
    elif searched.error is not None:  # Hypothesis's own error is never a finding: what the machine met is
        harness = HarnessError.of(searched.error, f"{name} under Hypothesis")
    elif isinstance(searched.failure, Exception):  # an exception from vLLM is a finding, reported with its program
        failure = searched.failure
        program = "\n".join(note for note in getattr(failure, "__notes__", ()) if note)
    if cut_off and shortest.failure is not None:
        failure, program = shortest.failure, shortest.source() + "\n# the search was cut off before it ended"
    return Outcome(
        setup,
        tally.examples,
        tally.steps,
        tally.preemptions,
        tally.hit_tokens,
        time.perf_counter() - started,
        failure,
        program,
        tally.drafts,
        tally.accepted_drafts,
        tally.rewrites,
        tally.transfers,
        tally.lora_held_back,
        harness,
        cut_off,
    )
