"""What it takes to run a campaign again: every setting of ``kvfuzz campaign`` it ran under, the seed among them
(the one given, or the one drawn when none was), as structured fields and as a command line to paste.

What a rerun repeats: every worker's seed stream derives from the seed alone (one per slot), so each slot draws the
same configurations and runs the same random programs in the same order. With one worker and an end that is counted
(``--max-examples`` or ``--stop-after``, not ``--duration``), a rerun with a fresh corpus and example database (or
the first run's corpus moved away) runs the same programs, meets the same signatures at the same example numbers and
saves the same traces. Not repeated: the Hypothesis rounds (one batch in four) replay the example database as it is
then and draw their other examples from Hypothesis's own random stream; with several workers, how far each one gets
and which meets a signature first depend on the machine's timing; with ``--duration``, so does where the campaign
stops; and a rerun on the first run's corpus knows its findings (its traces are there) and counts them as known.
"""

from __future__ import annotations

import shlex
from typing import Any, Optional

import attrs

from kvfuzz.scheduler.pins import Pins, pin_arguments


@attrs.frozen
class Rerun:
    """The settings a campaign ran under, as ``kvfuzz campaign``'s options name them. Invariant: :meth:`command`
    names every one of them, so that it does not depend on a default (but for the paths, which are as given:
    relative ones to ``directory``)."""

    allocators: tuple[str, ...]  # every allocator, patterns expanded
    seed: int  # the campaign's seed: given, or drawn
    workers: int
    duration: Optional[float]  # seconds; None: no time limit
    max_examples: Optional[int]
    stop_after: Optional[int]
    corpus: str  # --corpus, as given
    known: tuple[str, ...]  # the known corpora (--known, or ./corpus when it existed); () : none
    database: Optional[str]  # redis://... or an example-database directory; None: inside the corpus
    shrink_seconds: float  # --shrink-time
    call_timeout: Optional[float]  # --call-timeout; None: no watchdog (0 on the command line)
    directory: str  # where the campaign ran: relative paths are relative to it
    version: str  # kvfuzz's version

    def arguments(self) -> list[str]:
        """``kvfuzz campaign``'s arguments for the same campaign."""
        args: list[str] = []
        for spec in self.allocators:
            args += ["--allocator", spec]
        args += ["--seed", str(self.seed), "--workers", str(self.workers)]
        if self.duration is not None:
            args += ["--duration", repr(self.duration)]
        if self.max_examples is not None:
            args += ["--max-examples", str(self.max_examples)]
        if self.stop_after is not None:
            args += ["--stop-after", str(self.stop_after)]
        args += ["--corpus", self.corpus]
        for path in self.known:
            args += ["--known", path]
        if not self.known:
            args.append("--no-known")
        if self.database is not None:
            args += ["--database", self.database]
        args += ["--shrink-time", repr(self.shrink_seconds), "--call-timeout", repr(self.call_timeout or 0.0)]
        return args

    def command(self) -> str:
        """The command line, ready to paste in ``directory`` (each argument quoted for a POSIX shell)."""
        return shlex.join(["kvfuzz", "campaign", *self.arguments()])

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "allocators": list(self.allocators), "known": list(self.known)}


@attrs.frozen
class SchedulerRerun:
    """The settings a scheduler campaign (``kvfuzz campaign --scheduler``) ran under. Invariant: :meth:`command`
    names every one of them. What a rerun repeats: the seed alone decides every worker's batches (their
    configurations and Hypothesis seeds), so with one worker, an end that is counted (``--max-examples``,
    ``--stop-after``) and a fresh corpus, a rerun runs the same examples and finds the same failures; with several
    workers, how far each gets and which meets a failure first depend on the machine's timing, as with
    ``--duration`` where it stops."""

    scheduler: str
    seed: int
    duration: Optional[float]
    max_examples: Optional[int]
    stop_after: Optional[int]
    batch_examples: int  # examples per configuration drawn
    corpus: str
    known: tuple[str, ...]
    shrink: bool
    isolate: bool
    call_timeout: Optional[float]
    directory: str
    version: str
    pins: Pins = ()  # swarm rows held at one value (--pin)
    database: Optional[str] = None  # the Redis its claims and findings were shared in
    workers: int = 1
    coverage: bool = False  # --coverage: the engine's coverage measured
    guided: bool = False  # --guided: coverage feedback
    batch_seconds: Optional[float] = None  # --batch-seconds: the most a batch's search ran (None: no cap)

    def arguments(self) -> list[str]:
        args = ["--scheduler", self.scheduler, "--seed", str(self.seed), *pin_arguments(self.pins)]
        if self.duration is not None:
            args += ["--duration", repr(self.duration)]
        if self.max_examples is not None:
            args += ["--max-examples", str(self.max_examples)]
        if self.stop_after is not None:
            args += ["--stop-after", str(self.stop_after)]
        args += ["--batch-examples", str(self.batch_examples), "--corpus", self.corpus]
        if self.batch_seconds is not None:
            args += ["--batch-seconds", repr(self.batch_seconds)]
        for path in self.known:
            args += ["--known", path]
        if not self.known:
            args.append("--no-known")
        if not self.shrink:
            args.append("--no-shrink")
        if self.isolate:
            args.append("--isolate")
        args += ["--call-timeout", repr(self.call_timeout or 0.0), "--workers", str(self.workers)]
        if self.database is not None:
            args += ["--database", self.database]
        if self.guided:
            args.append("--guided")
        elif self.coverage:
            args.append("--coverage")
        return args

    def command(self) -> str:
        return shlex.join(["kvfuzz", "campaign", *self.arguments()])

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "known": list(self.known), "pins": dict(self.pins)}
