"""Where a workload's requests came from, and the rule that keeps the two kinds of evidence apart.

A **constructed** workload was made by a named generator from a seed: a shape worth testing against, not a
measurement. A **recorded** one was imported from a trace of real traffic (a file, in a named format). A table that
compares runs side by side (a sweep, capacity, an ablation) holds runs of one kind only: :func:`one_kind` refuses a
mix, so a constructed figure is never read beside a recorded one as if both were measurements.
"""

from __future__ import annotations

from typing import Iterable, Optional

import attrs

KINDS = ("constructed", "recorded")


class MixedEvidence(ValueError):
    """A table was asked to put constructed and recorded workloads side by side."""


@attrs.frozen
class Provenance:
    """A workload's origin: ``kind`` is ``constructed`` (then ``generator`` and ``seed`` say how) or ``recorded``
    (then ``source`` names the trace file and ``trace_format`` its format). A field left None is not known (a
    kvfuzz-workload/1 file that does not say)."""

    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))  # constructed or recorded
    generator: Optional[str] = None  # the generator that made a constructed workload
    seed: Optional[int] = None  # the generator's seed
    source: Optional[str] = None  # the file the workload was read or imported from
    trace_format: Optional[str] = None  # the format of an imported trace file

    def describe(self) -> str:
        if self.kind == "constructed":
            how = f"by {self.generator}" if self.generator else "by an unnamed generator"
            seed = f" (seed {self.seed})" if self.seed is not None else ""
            read = f", read from {self.source}" if self.source else ""
            return f"constructed {how}{seed}{read}"
        fmt = f" ({self.trace_format})" if self.trace_format else ""
        return f"recorded: imported from {self.source or 'an unnamed trace'}{fmt}"

    def to_json(self) -> dict:
        return {key: value for key, value in attrs.asdict(self).items() if value is not None}

    @classmethod
    def from_json(cls, data: object, where: str) -> "Provenance":
        """From a workload file's ``provenance`` object; raises ValueError naming what is wrong."""
        fields = attrs.fields_dict(cls)
        if not isinstance(data, dict) or not set(data) <= set(fields) or "kind" not in data:
            raise ValueError(f"{where}: 'provenance' must be an object with 'kind' and some of {', '.join(fields)}")
        if data["kind"] not in KINDS:
            raise ValueError(f"{where}: provenance 'kind' must be one of {KINDS}, found {data['kind']!r}")
        seed = data.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"{where}: provenance 'seed' must be an integer, found {seed!r}")
        for key in ("generator", "source", "trace_format"):
            if data.get(key) is not None and not isinstance(data[key], str):
                raise ValueError(f"{where}: provenance {key!r} must be a string, found {data[key]!r}")
        return cls(**data)


def one_kind(provenances: Iterable[Provenance], table: str) -> str:
    """The one kind of evidence ``provenances`` share; raises :class:`MixedEvidence` when they mix kinds."""
    kinds = sorted({provenance.kind for provenance in provenances})
    if len(kinds) > 1:
        raise MixedEvidence(
            f"{table}: refusing to put constructed and recorded workloads in one table; "
            "constructed shapes are not measurements of traffic, so compare each kind on its own"
        )
    if not kinds:
        raise ValueError(f"{table}: no runs to tabulate")
    return kinds[0]
