"""The findings a campaign already knows: the signatures of the traces in its corpus directories.

Each trace recorded against one of the campaign's allocators is replayed once, before the campaign starts, and the
signature of the failure it reproduces becomes known, so that the campaign counts it instead of reporting it as
new (a ``known_bug`` trace of this repository's corpus, a failure an earlier campaign saved). A trace that no longer
reproduces (the bug was fixed) makes nothing known. A trace of a process the allocator killed is not replayed (the
replay would die too): its signature is read from the trace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from kvfuzz.campaign.signature import TEARDOWN, Signature, signature_of
from kvfuzz.corpus import PROCESS_DIED
from kvfuzz.program.execution import Safeguards, Target
from kvfuzz.program.replay import NotApplicable, replay
from kvfuzz.program.safeguards import Watchdog
from kvfuzz.registry import AllocatorNotFound, load_factory
from kvfuzz.trace import Trace, TraceError, is_trace_file, load


def known_signatures(directories: Iterable[Path], allocators: Iterable[str], call_timeout: float) -> dict[str, str]:
    """Signature key -> where it is known from (``path`` or ``path (known bug: reason)``), for the traces in
    ``directories`` (not recursively) recorded against one of ``allocators``."""
    wanted = set(allocators)
    known: dict[str, str] = {}
    for directory in directories:
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("*.json")):
            if not is_trace_file(path):
                continue
            try:
                trace = load(path)
            except TraceError:
                continue
            if trace.allocator not in wanted:
                continue
            signature = trace_signature(trace, call_timeout)
            if signature is not None and signature.key() not in known:
                reason = f" (known bug: {trace.known_bug})" if trace.known_bug else ""
                known[signature.key()] = f"{path}{reason}"
    return known


def trace_signature(trace: Trace, call_timeout: float) -> Signature | None:
    """The signature of the failure ``trace`` reproduces now; None if it no longer does (or cannot be replayed)."""
    title = str(trace.failure.get("title"))
    if title.startswith(PROCESS_DIED):
        operation = trace.program[-1].rule if trace.program else TEARDOWN
        return Signature(trace.allocator, PROCESS_DIED, operation)
    try:
        factory = load_factory(trace.allocator)
        with Watchdog(call_timeout) as watchdog:
            outcome = replay(Target(factory, trace.config, safeguards=Safeguards(watchdog=watchdog)), trace.program)
    except (AllocatorNotFound, NotApplicable):
        return None
    if outcome.failure is None:
        return None
    return signature_of(trace.allocator, outcome.failure, trace.program, outcome.failed_at)
