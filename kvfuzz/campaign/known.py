"""The findings a campaign already knows: the signatures of the traces in its corpus directories.

Each trace recorded against one of the campaign's allocators is replayed once, before the campaign starts, and the
signature of the failure it reproduces becomes known, so that the campaign counts it instead of reporting it as
new (a ``known_bug`` trace of this repository's corpus, a failure an earlier campaign saved). Only the failure the
trace recorded becomes known, as ``kvfuzz replay`` judges it (:func:`~kvfuzz.saved.corpus.reproduces_recorded`: the
same invariant, for the same cause where the trace recorded one): a trace that no longer reproduces (the bug was
fixed) makes nothing known, and neither does one that now fails differently (a regression met on the known bug's
path), so that the campaign reports that new failure instead of counting it as the known bug. A signature names the
cause, not the operation that met it (:mod:`kvfuzz.shrink.signature`), so a known bug the campaign meets through
another operation is still the known one. A trace of a process the allocator killed is not replayed (the replay
would die too): its signature is read from the trace.

A trace is also replayed against the campaign's other allocators that run the same code: factories whose
allocators are instances of the same class as the trace's, configured differently (vLLM v0's block manager with and
without chunked-prefill preemption, vLLM v1's default and LoRA managers). Where the trace's program fails there with
the same failure, in the same operation and, for a crash, in the same frame as on the allocator it was recorded
against, it is the same bug met in another configuration: that allocator's signature is known too. A failure that
differs in any of those, or an allocator of another class (each zoo variant is one), stays new.

A trace recorded against an allocator that is neither one of the campaign's (the user named those) nor trusted by
:class:`~kvfuzz.registry.AllocatorTrust` is passed over unimported: a corpus directory may hold traces from
elsewhere, and a trace can name any importable callable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Optional

import attrs

from kvfuzz.allocator.types import PoolSpec
from kvfuzz.campaign.cluster import ClusterFindings, TooLarge, parse_finding
from kvfuzz.program.execution import Safeguards, Target
from kvfuzz.program.replay import NotApplicable, replay
from kvfuzz.program.safeguards import Watchdog
from kvfuzz.registry import AllocatorNotFound, AllocatorTrust, UntrustedAllocator, load_factory
from kvfuzz.saved.corpus import PROCESS_DIED, reproduces_recorded
from kvfuzz.saved.trace import Trace, TraceError, is_trace_file, load
from kvfuzz.shrink.signature import TEARDOWN, Signature, signature_of
from kvfuzz.text import printable


def known_signatures(directories: Iterable[Path], allocators: Iterable[str], call_timeout: float) -> dict[str, str]:
    """Signature key -> where it is known from (``path`` or ``path (known bug: reason)``, and for an allocator that
    runs the trace's code in another configuration, which), for the traces in ``directories`` (not recursively)
    recorded against one of ``allocators`` or against an allocator of the same class as one of them."""
    wanted = tuple(dict.fromkeys(allocators))
    classes = _ClassCache()
    known: dict[str, str] = {}
    for path, trace in _traces(directories):
        if trace.allocator not in wanted:
            try:
                AllocatorTrust().check(trace.allocator)
            except UntrustedAllocator:
                continue
        pool = trace.config.pool_spec()
        recorded = classes.of(trace.allocator, pool)
        died = str(trace.failure.get("title")).startswith(PROCESS_DIED)
        siblings = [
            spec
            for spec in wanted
            if spec != trace.allocator and not died and recorded is not None and classes.of(spec, pool) is recorded
        ]
        if trace.allocator not in wanted and not siblings:
            continue
        signature = trace_signature(trace, call_timeout)
        if signature is None:
            continue
        reason = f" (known bug: {printable(trace.known_bug)})" if trace.known_bug else ""
        if trace.allocator in wanted:
            known.setdefault(signature.key(), f"{printable(str(path))}{reason}")
        for spec in siblings:
            found = trace_signature(attrs.evolve(trace, allocator=spec), call_timeout)
            if found is not None and attrs.evolve(found, allocator=trace.allocator) == signature:
                known.setdefault(
                    found.key(),
                    f"{printable(str(path))}{reason}, recorded against {trace.allocator}, same failure here",
                )
    return known


def stored_findings_known(cluster: ClusterFindings, allocators: Iterable[str], call_timeout: float) -> dict[str, str]:
    """Signature key -> where it is known from, for the findings of a campaign's Redis stored under a key that is no
    longer their signature's (stored before checks named causes, or before a cause was refined): each one recorded
    against one of ``allocators`` is replayed, as a corpus trace is, and the signature it reproduces now is known,
    so that the campaign does not shrink and store the same bug again under its new key. The record itself stays
    under its old key, listed and fetched by ``kvfuzz findings`` as before. A finding stored under its current key
    needs none of this (its claim matches); one that no longer reproduces its recorded failure makes nothing
    known."""
    wanted = set(allocators)
    known: dict[str, str] = {}
    try:
        keys = cluster.keys().keys
    except TooLarge:  # more findings than kvfuzz reads: none re-keyed (kvfuzz findings says why)
        return known
    for key, raw in cluster.fetch(keys).items():
        if raw is None or isinstance(raw, TooLarge):
            continue
        try:
            finding = parse_finding(key, raw, f"{cluster.url} finding {printable(key)}")
        except TraceError:
            continue  # not ours to judge here: kvfuzz findings names what is wrong with it
        if not isinstance(finding.trace, Trace) or finding.trace.allocator not in wanted:
            continue  # a scheduler campaign's finding, or another allocator's
        signature = trace_signature(finding.trace, call_timeout)
        if signature is not None and signature.key() != key:
            known.setdefault(
                signature.key(),
                f"{cluster.url} finding {printable(key)} (stored as {finding.signature}, re-keyed on load)",
            )
    return known


def _traces(directories: Iterable[Path]) -> Iterator[tuple[Path, Trace]]:
    """The valid traces of ``directories`` (not recursively), in file-name order."""
    for directory in directories:
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("*.json")):
            if not is_trace_file(path):
                continue
            try:
                yield path, load(path)
            except TraceError:
                continue


class _ClassCache:
    """The class of the allocator a spec's factory builds for a pool, built once per (spec, pool); None where the
    factory cannot be loaded or refuses the pool."""

    def __init__(self) -> None:
        self.classes: dict[tuple[str, PoolSpec], Optional[type]] = {}

    def of(self, spec: str, pool: PoolSpec) -> Optional[type]:
        if (spec, pool) not in self.classes:
            self.classes[spec, pool] = _built_class(spec, pool)
        return self.classes[spec, pool]


def _built_class(spec: str, pool: PoolSpec) -> Optional[type]:
    try:
        factory = load_factory(spec)
    except AllocatorNotFound:
        return None
    try:
        return type(factory(pool))
    except Exception:  # noqa: BLE001 -- a factory that refuses this pool shares no trace recorded on it
        return None


def trace_signature(trace: Trace, call_timeout: float) -> Signature | None:
    """The signature of the failure ``trace`` reproduces now; None if it no longer does, fails otherwise than it
    recorded (another invariant, or the same for another cause), or cannot be replayed."""
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
    if not reproduces_recorded(trace, outcome.failure):
        return None
    assert outcome.failure is not None  # reproduces_recorded says so
    return signature_of(trace.allocator, outcome.failure, trace.program, outcome.failed_at, outcome.diverged)
