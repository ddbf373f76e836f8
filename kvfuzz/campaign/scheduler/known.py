"""The findings a scheduler campaign already knows: the signatures of the scheduler traces in its corpus
directories.

Each scheduler trace recorded against the campaign's scheduler is replayed once, before the campaign starts, with
its own configuration and model runner protocol; only when it reproduces the failure it recorded (the same check,
or for a crash the same exception type, as ``kvfuzz replay`` judges it) does the signature of that failure become
known. A trace that no longer fails (the bug was fixed) makes nothing known, nor one that now fails otherwise (a
regression met on the known bug's path stays new), nor one this vLLM cannot replay. A trace of a bug the engine has
fixed (its ``fixed`` names the fix: the corpus's regression traces) that reproduces makes its signature a
**regression**: met, it is reported as new, never counted as known, whatever other trace shares the signature.
Several traces may share a signature (one bug recorded under two model runners, say): a finding is credited to the
one recorded in the configuration closest to the batch that met it. A trace of an isolated batch
whose process died is not replayed (the replay would kill the campaign): its signature is read from the trace.
Allocator traces and other files in the directories are passed over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Optional

import attrs

from kvfuzz.campaign.scheduler.target import SchedulerProcessDied, SchedulerTarget, scheduler_signature
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.replay import ReplayRefused
from kvfuzz.scheduler.trace import FORMAT, PROCESS_DIED, SchedulerTrace, SchedulerTraceError, load
from kvfuzz.text import printable


@attrs.frozen
class KnownTrace:
    """A corpus trace that reproduces its failure here: where it is, and what it ran (for crediting a finding met in
    one configuration to the trace recorded in the closest one)."""

    where: str  # ``path``, or ``path (known bug: reason)``, or ``path (fixed: the fix)``
    setup: SchedulerSetup
    model_runner: str


@attrs.frozen
class KnownFindings:
    """What the corpus says of each signature before a campaign: ``known`` (counted when met) or, for a trace of a
    fixed bug (``fixed``) that reproduces, a ``regression`` (reported as new, with the trace that says so)."""

    known: dict[str, tuple[KnownTrace, ...]] = attrs.field(factory=dict)
    regressions: dict[str, tuple[KnownTrace, ...]] = attrs.field(factory=dict)

    def credit(self, key: str, setup: SchedulerSetup, model_runner: str, regression: bool = False) -> str:
        """Where the finding of ``key``, met in ``setup`` under ``model_runner``, is known from: of the traces that
        share its signature, the one recorded in the configuration closest to it (the same model runner, then the
        most equal fields), the first in file-name order among equals; the others named after it."""
        traces = (self.regressions if regression else self.known)[key]
        met = attrs.asdict(setup)

        def distance(trace: KnownTrace) -> tuple[int, int]:
            fields = attrs.asdict(trace.setup)
            return int(trace.model_runner != model_runner), sum(fields[name] != met[name] for name in fields)

        best = min(traces, key=distance)
        others = [trace.where for trace in traces if trace is not best]
        return best.where + (f"; also {', '.join(others)}" if others else "")


def known_signatures(
    directories: Iterable[Path], target: SchedulerTarget, call_timeout: Optional[float]
) -> KnownFindings:
    """The signatures the traces of ``directories`` reproduce here, known or (a ``fixed`` trace's) regressions."""
    known: dict[str, list[KnownTrace]] = {}
    regressions: dict[str, list[KnownTrace]] = {}
    for path, trace in scheduler_traces(directories):
        if trace.scheduler != target.name:
            continue
        reason = (
            f" (known bug: {printable(trace.known_bug)})"
            if trace.known_bug
            else f" (fixed: {printable(trace.fixed)})"
            if trace.fixed
            else ""
        )
        entry = KnownTrace(f"{printable(str(path))}{reason}", trace.setup, trace.model_runner)
        if trace.failure.exception == PROCESS_DIED:  # its replay would kill this process: known as recorded
            died = SchedulerProcessDied(trace.failure.message)
            known.setdefault(scheduler_signature(trace.scheduler, died).key(), []).append(entry)
            continue
        try:
            replayed = target.replay(trace, call_timeout)
        except ReplayRefused:
            continue
        if not replayed.reproduced or replayed.error is None:
            continue
        key = scheduler_signature(trace.scheduler, replayed.error).key()
        (regressions if trace.fixed else known).setdefault(key, []).append(entry)
    return KnownFindings(
        {key: tuple(traces) for key, traces in known.items() if key not in regressions},
        {key: tuple(traces) for key, traces in regressions.items()},
    )


def scheduler_traces(directories: Iterable[Path]) -> Iterator[tuple[Path, SchedulerTrace]]:
    """The valid scheduler traces of ``directories`` (not recursively), in file-name order."""
    for directory in directories:
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("*.json")):
            try:
                with open(path, encoding="utf-8", errors="replace") as stream:
                    if FORMAT not in stream.read(200):
                        continue  # an allocator trace, or another file: not read further
                yield path, load(path)
            except (OSError, SchedulerTraceError):
                continue
