"""Two measurements of the same engine code side by side: what a campaign reached (``kvfuzz campaign --coverage
--json``) beside what the engine's own tests reached (``scripts/vllm_tests_coverage.py --json``), file by file,
with their union and the points each reached alone, and the functions that hold the gap.

The two measurements may come from two environments (two copies of the same release): a file is named by its path
inside its package (``vllm/v1/core/block_pool.py``), and its points are read from whichever copy this machine has;
two copies that differ are refused (the points would not compare). What a target leaves out of scope (the docs'
"What stays out": multimodal encoder inputs, whole functions and the branches they guard in others) is left out of
both sides and of the totals, unless asked not to; both sides are always counted the same way.

Invariant: every figure counts points of the file's functions only (:mod:`kvfuzz.coverage.static`), so a point a
side reached that the file does not hold (another version's line) counts for neither side.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Optional

import attrs

from kvfuzz.coverage.measure import Reached
from kvfuzz.coverage.report import display_name
from kvfuzz.coverage.scope import LeftOut
from kvfuzz.coverage.static import Branch, FunctionPoints, function_points, guarded_lines


class ComparisonError(Exception):
    """The two measurements cannot be compared (a file unreadable, two different copies of a file, a JSON that
    holds no points); the message says which."""


def package_path(path: str) -> str:
    """``path`` named inside its installed package (after the last ``site-packages/``), else as a person names it
    here (:func:`~kvfuzz.coverage.report.display_name`)."""
    for marker in ("site-packages", "dist-packages"):
        head, found, tail = path.rpartition(os.sep + marker + os.sep)
        if found:
            return tail
    return display_name(path)


@attrs.frozen
class Measurement:
    """One side: what it reached, by file (named by :func:`package_path`), and where each file lies on the machine
    that measured it."""

    label: str  # "vLLM's tests", "the campaign"
    points: Mapping[str, Reached]  # package path -> the points reached in that file (paths as measured)
    paths: Mapping[str, str]  # package path -> the file's path where it was measured

    @classmethod
    def from_json(cls, label: str, data: Mapping[str, Any]) -> Measurement:
        """From a JSON report holding ``points`` at its top (the tests' script) or under ``coverage`` (a campaign's
        ``--json``); raises :class:`ComparisonError` for one holding neither."""
        raw = data.get("points")
        if raw is None and isinstance(data.get("coverage"), Mapping):
            raw = data["coverage"].get("points")
        if not isinstance(raw, Mapping):
            raise ComparisonError(
                f"{label}: the JSON holds no points (a campaign's needs --coverage and --json; the tests' script's, "
                "--json)"
            )
        points = {}
        paths = {}
        for path, reached in raw.items():
            name = package_path(str(path))
            points[name] = Reached.from_json({path: reached})
            paths[name] = str(path)
        return cls(label, points, paths)

    @classmethod
    def load(cls, label: str, file: Path) -> Measurement:
        try:
            return cls.from_json(label, json.loads(file.read_text(encoding="utf-8")))
        except (OSError, ValueError) as error:
            raise ComparisonError(f"{label}: cannot read {file}: {error}") from error


@attrs.frozen
class FileComparison:
    """One file's figures: its points (out-of-scope functions left out), and how many each side, their union, and
    each side alone reached."""

    name: str
    points: int
    tests: int
    campaign: int
    union: int
    tests_only: int
    campaign_only: int

    def percent(self, reached: int) -> float:
        return 100.0 * reached / self.points if self.points else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            **attrs.asdict(self),
            "tests_percent": round(self.percent(self.tests), 1),
            "campaign_percent": round(self.percent(self.campaign), 1),
            "union_percent": round(self.percent(self.union), 1),
        }


@attrs.frozen
class FunctionGap:
    """One function of a file: its points, and how many each side reached."""

    file: str
    qualname: str
    first_line: int
    points: int
    tests: int
    campaign: int

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class Comparison:
    """Each file's figures, every function's (the gap is ``tests - campaign``), and the functions left out."""

    files: tuple[FileComparison, ...]
    functions: tuple[FunctionGap, ...]
    left_out: tuple[str, ...]  # "file: qualname" of each function left out of both sides
    guarded: tuple[str, ...] = ()  # "file: lines ... (N points)": the code the left-out guards guard, by file

    def widest_gaps(self, count: int) -> tuple[FunctionGap, ...]:
        """The ``count`` functions where the tests reached the most points the campaign did not."""
        behind = [function for function in self.functions if function.tests > function.campaign]
        return tuple(sorted(behind, key=lambda function: function.campaign - function.tests)[:count])

    def to_json(self) -> dict[str, Any]:
        return {
            "files": [file.to_json() for file in self.files],
            "functions": [function.to_json() for function in self.functions],
            "left_out": list(self.left_out),
            "guarded": list(self.guarded),
        }


def _same_source(first: str, second: str) -> bool:
    """Whether two copies of a file hold the same bytes (a copy this machine cannot read compares as unknown: true)."""
    try:
        return hashlib.sha256(Path(first).read_bytes()).digest() == hashlib.sha256(Path(second).read_bytes()).digest()
    except OSError:
        return True


def _source(name: str, tests: Measurement, campaign: Measurement) -> str:
    """The path of ``name`` to read its functions from; raises :class:`ComparisonError` when no copy is readable here
    or the two copies differ."""
    copies = [side.paths[name] for side in (tests, campaign) if name in side.paths]
    readable = [path for path in copies if Path(path).is_file()]
    if not readable:
        raise ComparisonError(f"{name}: neither measurement's copy ({', '.join(copies)}) is on this machine")
    if len(readable) == 2 and not _same_source(*readable):
        raise ComparisonError(
            f"{name}: the two measurements ran different sources ({readable[0]} and {readable[1]} differ): measure "
            "both on the same release"
        )
    return readable[0]


@attrs.frozen
class _Positions:
    """The points one side reached in one file, by position alone (each side names the file with its own machine's
    path), read once per file."""

    lines: frozenset[int] = frozenset()
    branches: frozenset[Branch] = frozenset()

    @classmethod
    def of(cls, reached: Optional[Reached]) -> _Positions:
        if reached is None:
            return cls()
        return cls(frozenset(line for _, line in reached.lines), frozenset((a, b) for _, a, b in reached.branches))

    def __or__(self, other: _Positions) -> _Positions:
        return _Positions(self.lines | other.lines, self.branches | other.branches)

    def count(self, function: FunctionPoints) -> int:
        """How many of ``function``'s points these are."""
        return len(function.lines & self.lines) + len(function.branches & self.branches)


def _without(function: FunctionPoints, lines: frozenset[int]) -> FunctionPoints:
    """``function`` without the points on ``lines``: those lines, and the branches that leave or land on one."""
    if not lines:
        return function
    return attrs.evolve(
        function,
        lines=function.lines - lines,
        branches=frozenset(branch for branch in function.branches if branch[0] not in lines and branch[1] not in lines),
    )


def _spans(lines: Iterable[int]) -> str:
    """``lines`` as ranges: "828-835, 871-882"."""
    spans: list[list[int]] = []
    for line in sorted(lines):
        if spans and line == spans[-1][1] + 1:
            spans[-1][1] = line
        else:
            spans.append([line, line])
    return ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in spans)


def compare(
    tests: Measurement,
    campaign: Measurement,
    files: Iterable[str],
    left_out: Mapping[str, LeftOut] = MappingProxyType({}),
) -> Comparison:
    """The two sides' figures on ``files`` (package paths), leaving out of both what ``left_out`` names per file:
    functions by qualname (their nested functions too), and the ``if`` statements its guards name in the others."""
    rows = []
    gaps = []
    dropped = []
    guarded_code = []
    for name in files:
        if name not in tests.paths and name not in campaign.paths:
            continue
        source = _source(name, tests, campaign)
        found = function_points(source)
        if found is None:
            raise ComparisonError(f"{name}: cannot be read or compiled here")
        left = left_out.get(name, LeftOut())
        skipped = left.functions
        guarded = guarded_lines(source, left.guards)
        in_tests, in_campaign = _Positions.of(tests.points.get(name)), _Positions.of(campaign.points.get(name))
        in_either = in_tests | in_campaign
        totals = [0, 0, 0, 0, 0, 0]  # points, tests, campaign, union, tests only, campaign only
        guarded_points = 0
        guarded_here: set[int] = set()  # the lines of the functions counted that a left-out guard guards
        for function in found:
            if any(function.qualname == out or function.qualname.startswith(out + ".") for out in skipped):
                dropped.append(f"{name}: {function.qualname}")
                continue
            unguarded = _without(function, guarded)
            guarded_points += function.size - unguarded.size
            guarded_here |= function.lines & guarded
            function = unguarded
            by_tests, by_campaign, union = (
                in_tests.count(function),
                in_campaign.count(function),
                in_either.count(function),
            )
            for index, value in enumerate(
                (function.size, by_tests, by_campaign, union, union - by_campaign, union - by_tests)
            ):
                totals[index] += value
            gaps.append(FunctionGap(name, function.qualname, function.first_line, function.size, by_tests, by_campaign))
        rows.append(FileComparison(name, *totals))
        if guarded_points:
            guarded_code.append(f"{name}: lines {_spans(guarded_here)} ({guarded_points} points)")
    return Comparison(tuple(rows), tuple(gaps), tuple(dropped), tuple(guarded_code))
