"""The findings a campaign already knows, for every target: the signatures its corpus directories' traces reproduce
here, and (with Redis) those of findings stored under a key that is no longer their signature's.

Each trace of the campaign's target is replayed once, before the campaign starts, by the target's
:class:`KnownSource`, and only the failure the trace recorded becomes known, as ``kvfuzz replay`` judges it: a trace
that no longer reproduces (the bug was fixed) makes nothing known, and neither does one that now fails otherwise (a
regression met on the known bug's path stays new), nor one the installed engine cannot replay. A trace of a process
that died is not replayed (the replay would die too): its signature is read from the trace.

A trace whose ``fixed`` names the fix of the bug it recorded (a regression trace) and that reproduces makes its
signature a **regression**: met, it is reported as new, never counted as known, whatever other trace shares the
signature. Several traces may share a signature (one bug recorded in two configurations): a finding is credited to
the one recorded in the configuration closest to the batch that met it (:meth:`KnownFindings.credit`).

What is the target's own (:class:`KnownSource`): which files are its traces, how one is read, and which signatures it
reproduces here (an allocator's trace, for instance, also for the campaign's allocators of the same class)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional, Protocol

import attrs

from kvfuzz.campaign.cluster import ClusterFindings, TooLarge, parse_finding
from kvfuzz.shrink.signature import Signature
from kvfuzz.text import printable
from kvfuzz.trace_files import json_file_kind


@attrs.frozen
class Recorded:
    """The configuration a trace was recorded in, or a finding was met in, as the closeness of two is measured: its
    ``kind`` first (the allocator, the model runner protocol), then how many of its ``fields`` differ."""

    kind: str
    fields: Mapping[str, Any] = attrs.field(factory=dict)

    def distance(self, other: Recorded) -> tuple[int, int]:
        """How far ``other`` is from this one: whether its kind differs, then the number of fields that do."""
        names = set(self.fields) | set(other.fields)
        return int(self.kind != other.kind), sum(self.fields.get(name) != other.fields.get(name) for name in names)


@attrs.frozen
class KnownTrace:
    """A trace that reproduces its failure here: where it is known from, for a person, and what it was recorded in."""

    where: str  # ``path``, ``path (known bug: reason)``, ``path (fixed: the fix)``, and what else the source says
    recorded: Recorded


@attrs.frozen
class Judged:
    """One signature a trace reproduces here (``key``), and whether it is a fixed bug's, a regression."""

    key: str
    trace: KnownTrace
    regression: bool = False


@attrs.frozen
class KnownFindings:
    """What the corpus says of each signature before a campaign. Invariant: a key is in ``known`` (counted when met)
    or in ``regressions`` (reported as new, with the trace that says so), never both; each holds its traces in the
    order they were judged (file-name order, corpus by corpus)."""

    known: Mapping[str, tuple[KnownTrace, ...]] = attrs.field(factory=dict)
    regressions: Mapping[str, tuple[KnownTrace, ...]] = attrs.field(factory=dict)

    @classmethod
    def of(cls, judged: Iterable[Judged]) -> KnownFindings:
        known: dict[str, list[KnownTrace]] = {}
        regressions: dict[str, list[KnownTrace]] = {}
        for entry in judged:
            (regressions if entry.regression else known).setdefault(entry.key, []).append(entry.trace)
        return cls(
            {key: tuple(traces) for key, traces in known.items() if key not in regressions},
            {key: tuple(traces) for key, traces in regressions.items()},
        )

    def __contains__(self, key: object) -> bool:
        """Whether a finding of ``key`` is counted as known (a regression's is not)."""
        return key in self.known

    def where(self) -> dict[str, str]:
        """Signature key -> where its first known trace is (regressions left out)."""
        return {key: traces[0].where for key, traces in self.known.items()}

    def then(self, other: KnownFindings) -> KnownFindings:
        """These findings, then ``other``'s traces after them (a key's regression wins over its known traces)."""
        entries = [
            Judged(key, trace, regression)
            for findings in (self, other)
            for regression, table in ((False, findings.known), (True, findings.regressions))
            for key, traces in table.items()
            for trace in traces
        ]
        return KnownFindings.of(entries)

    def claimed_as(self, signature: Signature) -> Signature:
        """The signature a finding is claimed under: its own, or for a regression a claim of its own, so that the
        claim made when the bug was first found (kept in a Redis that outlives campaigns, or in the corpus's claims)
        does not count the regression as met before."""
        if signature.key() in self.regressions:
            return attrs.evolve(signature, failure=f"{signature.failure} (regression)")
        return signature

    def credit(self, key: str, met: Optional[Recorded], regression: bool = False) -> str:
        """Where the finding of ``key``, met in ``met``, is known from: of the traces that share its signature, the
        one recorded closest to it (:meth:`Recorded.distance`), the first in order among equals (the first, where
        what it was met in is not known); the others named after it."""
        traces = (self.regressions if regression else self.known)[key]
        best = traces[0] if met is None else min(traces, key=lambda trace: trace.recorded.distance(met))
        others = [trace.where for trace in traces if trace is not best]
        return best.where + (f"; also {', '.join(others)}" if others else "")

    def noted(self, key: str, met: Optional[Recorded], note: Optional[str]) -> Optional[str]:
        """The note a saved finding of ``key``, met in ``met`` (None: not known), is reported with: ``note``, led for a
        regression by what says so (the fixed bug's trace recorded closest to ``met``: :meth:`credit`)."""
        if key not in self.regressions:
            return note
        back = f"REGRESSION: a fixed bug is back, {self.credit(key, met, regression=True)}"
        return f"{back}; {note}" if note else back


class KnownSource(Protocol):
    """What a target contributes to its known findings."""

    @property
    def kind(self) -> str:
        """:func:`~kvfuzz.trace_files.json_file_kind`'s name for the target's trace files."""
        ...

    def load(self, path: Path) -> Any:
        """The trace at ``path``; raises ``ValueError`` (its trace error) for a file that is not a valid one."""
        ...

    def judge(self, where: str, trace: Any) -> Iterable[Judged]:
        """The signatures ``trace`` (known from ``where``) reproduces here: none for a trace of another target or
        engine, or one that no longer reproduces what it recorded; may raise the target's harness error."""
        ...


def where_of(where: str, known_bug: Optional[str], fixed: Optional[str]) -> str:
    """A trace's ``where`` for a person: with its known bug's reason, or the fix of its fixed bug."""
    if known_bug:
        return f"{where} (known bug: {printable(known_bug)})"
    return f"{where} (fixed: {printable(fixed)})" if fixed else where


def known_findings(directories: Iterable[Path], source: KnownSource) -> KnownFindings:
    """The signatures the traces of ``directories`` (not recursively, in file-name order; a directory named twice,
    the campaign's own corpus among the known ones, read once) reproduce here."""
    return KnownFindings.of(
        judged for path, trace in traces_of(directories, source) for judged in source.judge(printable(str(path)), trace)
    )


def traces_of(directories: Iterable[Path], source: KnownSource) -> Iterator[tuple[Path, Any]]:
    """The valid traces of ``source``'s kind in ``directories`` (not recursively), in file-name order; other files,
    and traces that do not load, are passed over."""
    read: set[Path] = set()
    for directory in directories:
        if not directory.is_dir() or directory.resolve() in read:
            continue
        read.add(directory.resolve())
        for path in sorted(directory.glob("*.json")):
            if json_file_kind(path) != source.kind:
                continue
            try:
                yield path, source.load(path)
            except (OSError, ValueError):
                continue


def stored_findings_known(cluster: ClusterFindings, source: KnownSource) -> KnownFindings:
    """The findings of a campaign's Redis stored under a key that is no longer their signature's (stored before
    checks named causes, or before a cause was refined): each of ``source``'s target is replayed, as a corpus trace
    is, and the signature it reproduces now is known (or a regression), so that the campaign does not shrink and
    store the same bug again under its new key. The record stays under its old key, listed and fetched by ``kvfuzz
    findings`` as before. A finding stored under its current key makes nothing known through its own key (its claim
    matches already), but the source may know it under others (an allocator's of the same class as the finding's);
    one that no longer reproduces its recorded failure makes nothing known."""
    try:
        keys = cluster.keys().keys
    except TooLarge:  # more findings than kvfuzz reads: none re-keyed (kvfuzz findings says why)
        return KnownFindings()
    judged: list[Judged] = []
    for key, raw in cluster.fetch(keys).items():
        if raw is None or isinstance(raw, TooLarge):
            continue
        where = f"{cluster.url} finding {printable(key)}"
        try:
            finding = parse_finding(key, raw, where)
        except ValueError:
            continue  # not ours to judge here: kvfuzz findings names what is wrong with it
        stored = f"{where} (stored as {finding.signature}, re-keyed on load)"
        judged += [entry for entry in source.judge(stored, finding.trace) if entry.key != key]
    return KnownFindings.of(judged)
