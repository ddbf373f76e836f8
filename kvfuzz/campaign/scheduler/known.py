"""The findings a scheduler campaign already knows: the signatures of the scheduler traces in its corpus
directories.

Each scheduler trace recorded against the campaign's scheduler is replayed once, before the campaign starts, with
its own configuration and model runner protocol; only when it reproduces the failure it recorded (the same check,
or for a crash the same exception type, as ``kvfuzz replay`` judges it) does the signature of that failure become
known. A trace that no longer fails (the bug was fixed) makes nothing known, nor one that now fails otherwise (a
regression met on the known bug's path stays new), nor one this vLLM cannot replay. A trace of an isolated batch
whose process died is not replayed (the replay would kill the campaign): its signature is read from the trace.
Allocator traces and other files in the directories are passed over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Optional

from kvfuzz.campaign.scheduler.target import PROCESS_DIED, SchedulerProcessDied, SchedulerTarget, scheduler_signature
from kvfuzz.scheduler.replay import ReplayRefused
from kvfuzz.scheduler.trace import FORMAT, SchedulerTrace, SchedulerTraceError, load
from kvfuzz.text import printable


def known_signatures(
    directories: Iterable[Path], target: SchedulerTarget, call_timeout: Optional[float]
) -> dict[str, str]:
    """Signature key -> where it is known from (``path``, or ``path (known bug: reason)``)."""
    known: dict[str, str] = {}
    for path, trace in scheduler_traces(directories):
        if trace.scheduler != target.name:
            continue
        reason = f" (known bug: {printable(trace.known_bug)})" if trace.known_bug else ""
        if trace.failure.exception == PROCESS_DIED:  # its replay would kill this process: known as recorded
            died = SchedulerProcessDied(trace.failure.message)
            known.setdefault(scheduler_signature(trace.scheduler, died).key(), f"{printable(str(path))}{reason}")
            continue
        try:
            replayed = target.replay(trace, call_timeout)
        except ReplayRefused:
            continue
        if not replayed.reproduced or replayed.error is None:
            continue
        known.setdefault(scheduler_signature(trace.scheduler, replayed.error).key(), f"{printable(str(path))}{reason}")
    return known


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
