"""What it takes to run a campaign again, whatever its target: every setting of ``kvfuzz campaign`` it ran under, the
seed among them (the one given, or the one drawn when none was), as structured fields and as a command line to
paste. The settings every campaign has are here, the pins and the coverage feedback among them; a target adds its own
(:class:`TargetRerun`: the allocators and the shrink time; a scheduler, its batches and isolation).

What a rerun repeats: every worker's seed stream derives from the seed alone (one per slot), so each slot draws the
same configurations and runs the same random programs in the same order. With one worker and an end that is counted
(``--max-examples`` or ``--stop-after``, not ``--duration``), a rerun with a fresh corpus and example database (or
the first run's corpus moved away) runs the same programs, meets the same signatures at the same example numbers and
saves the same traces. Not repeated: the Hypothesis rounds (one batch in four) replay the example database as it is
then and draw their other examples from Hypothesis's own random stream; with several workers, how far each one gets
and which meets a signature first depend on the machine's timing; with ``--duration``, so does where the campaign
stops; and a rerun on the first run's corpus knows its findings (its traces are there) and counts them as known.
A scheduler campaign's seed alone decides every worker's batches (their configurations and Hypothesis seeds), so
with one worker, an end that is counted and a fresh corpus, a rerun runs the same examples and finds the same
failures.
"""

from __future__ import annotations

import os
import shlex
from typing import Any, Optional, Protocol

import attrs

import kvfuzz
from kvfuzz.campaign.settings import Settings
from kvfuzz.swarm_table import Pins, pin_arguments


class TargetRerun(Protocol):
    """A target's own settings of a campaign: what names the target, and its options no other target has."""

    def target(self) -> list[str]:
        """``kvfuzz campaign``'s arguments that name the target (``--allocator A``, ``--scheduler vllm-v1``)."""
        ...

    def options(self) -> list[str]:
        """Its own options' arguments (``--shrink-time 30.0``, ``--batch-examples 25``), each named whatever its
        default."""
        ...

    def to_json(self) -> dict[str, Any]:
        """The same, as the fields of the rerun's JSON."""
        ...


@attrs.frozen
class Rerun:
    """The settings a campaign ran under, as ``kvfuzz campaign``'s options name them. Invariant: :meth:`command`
    names every one of them, so that it does not depend on a default (but for the paths, which are as given:
    relative ones to ``directory``)."""

    target: TargetRerun  # what names the target, and its own options
    seed: int  # the campaign's seed: given, or drawn
    workers: int
    duration: Optional[float]  # seconds; None: no time limit
    max_examples: Optional[int]
    stop_after: Optional[int]
    corpus: str  # --corpus, as given
    known: tuple[str, ...]  # the known corpora (--known, or ./corpus when it existed); () : none
    database: Optional[str]  # redis://... or an example-database directory; None: the campaign's own
    call_timeout: Optional[float]  # --call-timeout; None: no watchdog (0 on the command line)
    pins: Pins  # rows of the target's swarm table held at one value (--pin)
    coverage: bool  # --coverage: the code under test's coverage measured
    guided: bool  # --guided: and used as the search's signal
    directory: str  # where the campaign ran: relative paths are relative to it
    version: str  # kvfuzz's version

    @classmethod
    def of(cls, target: TargetRerun, settings: Settings, known: tuple[str, ...]) -> Rerun:
        """The settings of a campaign run with ``settings`` in this directory, by this kvfuzz."""
        return cls(
            target,
            settings.seed,
            settings.workers,
            settings.duration,
            settings.max_examples,
            settings.stop_after,
            str(settings.corpus),
            known,
            settings.database,
            settings.call_timeout,
            settings.pins,
            settings.coverage,
            settings.guided,
            os.getcwd(),
            kvfuzz.__version__,
        )

    def arguments(self) -> list[str]:
        """``kvfuzz campaign``'s arguments for the same campaign."""
        args = [*self.target.target(), "--seed", str(self.seed), "--workers", str(self.workers)]
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
        args += ["--call-timeout", repr(self.call_timeout or 0.0), *pin_arguments(self.pins)]
        if self.guided:
            args.append("--guided")
        elif self.coverage:
            args.append("--coverage")
        return [*args, *self.target.options()]

    def command(self) -> str:
        """The command line, ready to paste in ``directory`` (each argument quoted for a POSIX shell)."""
        return shlex.join(["kvfuzz", "campaign", *self.arguments()])

    def to_json(self) -> dict[str, Any]:
        common = {field.name: getattr(self, field.name) for field in attrs.fields(Rerun) if field.name != "target"}
        return {**self.target.to_json(), **common, "known": list(self.known), "pins": dict(self.pins)}
