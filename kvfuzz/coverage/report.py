"""What a campaign reached of the code under test, for a person: per file and in all, lines and branches reached of
those the files' functions hold (:mod:`kvfuzz.coverage.static`), the figure coverage.py calls line + branch
combined (points reached / points), and an HTML report that shows each file's lines reached, missed, and partly
reached (a branch of the line never taken)."""

from __future__ import annotations

import functools
import html
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import attrs

from kvfuzz.coverage.measure import Reached
from kvfuzz.coverage.scope import display_name
from kvfuzz.coverage.static import FilePoints, file_points


@functools.lru_cache(maxsize=None)
def _points(path: str) -> Optional[FilePoints]:
    return file_points(path)


@attrs.frozen
class FileCoverage:
    """One file's figures."""

    path: str
    name: str  # display_name(path)
    lines: int
    lines_reached: int
    branches: int
    branches_reached: int

    @property
    def percent(self) -> float:
        """Line + branch combined: the points reached of all points, in percent (100 for a file without any)."""
        total = self.lines + self.branches
        return 100.0 * (self.lines_reached + self.branches_reached) / total if total else 100.0

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "percent": round(self.percent, 1)}


@attrs.frozen
class CoverageSummary:
    """Every reported file's figures, and their sums."""

    files: tuple[FileCoverage, ...]

    @property
    def lines(self) -> int:
        return sum(file.lines for file in self.files)

    @property
    def lines_reached(self) -> int:
        return sum(file.lines_reached for file in self.files)

    @property
    def branches(self) -> int:
        return sum(file.branches for file in self.files)

    @property
    def branches_reached(self) -> int:
        return sum(file.branches_reached for file in self.files)

    @property
    def percent(self) -> float:
        total = self.lines + self.branches
        return 100.0 * (self.lines_reached + self.branches_reached) / total if total else 100.0

    def describe(self) -> str:
        """One line: lines and branches reached of how many, in how many files."""
        return (
            f"{self.lines_reached} of {self.lines} lines, {self.branches_reached} of {self.branches} branches "
            f"({self.percent:.1f}% line + branch) in {len(self.files)} files of the code under test"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "lines": self.lines,
            "lines_reached": self.lines_reached,
            "branches": self.branches,
            "branches_reached": self.branches_reached,
            "percent": round(self.percent, 1),
            "files": [file.to_json() for file in self.files],
        }


def summarize(reached: Reached, files: Iterable[str]) -> CoverageSummary:
    """The figures of ``files`` given the points ``reached`` (points of other files, or that a file's functions do
    not hold, are not counted)."""
    rows = []
    for path in sorted(set(files)):
        points = _points(path)
        if points is None:
            continue
        lines = {line for where, line in reached.lines if where == path} & points.lines
        branches = {(start, end) for where, start, end in reached.branches if where == path} & points.branches
        rows.append(
            FileCoverage(path, display_name(path), len(points.lines), len(lines), len(points.branches), len(branches))
        )
    return CoverageSummary(tuple(rows))


def write_html(directory: Path, reached: Reached, files: Iterable[str], title: str) -> Path:
    """Write an HTML report of ``files`` into ``directory`` (an index, and a page per file: each function line
    reached, missed, or partly reached, with the branches it never took); returns the index."""
    directory.mkdir(parents=True, exist_ok=True)
    summary = summarize(reached, files)
    rows = []
    for number, file in enumerate(summary.files):
        page = f"file{number}.html"
        (directory / page).write_text(_file_page(file, reached, title), encoding="utf-8")
        rows.append(
            f"<tr><td><a href='{page}'>{html.escape(file.name)}</a></td><td>{file.lines_reached}/{file.lines}</td>"
            f"<td>{file.branches_reached}/{file.branches}</td><td>{file.percent:.1f}%</td></tr>"
        )
    index = directory / "index.html"
    index.write_text(
        _page(
            title,
            f"<h1>{html.escape(title)}</h1><p>{html.escape(summary.describe())}</p><table><tr><th>file</th>"
            f"<th>lines</th><th>branches</th><th>line + branch</th></tr>{''.join(rows)}</table>",
        ),
        encoding="utf-8",
    )
    return index


def _file_page(file: FileCoverage, reached: Reached, title: str) -> str:
    points = _points(file.path)
    assert points is not None  # summarize() kept only files with points
    lines = {line for where, line in reached.lines if where == file.path}
    taken = {(start, end) for where, start, end in reached.branches if where == file.path}
    missed: dict[int, list[int]] = {}
    for start, end in sorted(points.branches - taken):
        missed.setdefault(start, []).append(end)
    body = []
    source = Path(file.path).read_text(encoding="utf-8").splitlines()
    for number, text in enumerate(source, 1):
        if number not in points.lines:
            kind = ""
        elif number not in lines:
            kind = "miss"
        elif number in missed:
            kind = "partial"
        else:
            kind = "hit"
        note = f"  # never to line {', '.join(map(str, missed[number]))}" if number in missed and kind else ""
        body.append(
            f"<tr class='{kind}'><td class='n'>{number}</td><td><pre>{html.escape(text)}"
            f"<span class='note'>{html.escape(note)}</span></pre></td></tr>"
        )
    heading = (
        f"<h1>{html.escape(file.name)}</h1><p><a href='index.html'>{html.escape(title)}</a>: "
        f"{file.lines_reached} of {file.lines} lines, {file.branches_reached} of {file.branches} branches "
        f"({file.percent:.1f}%); green reached, red never reached, yellow reached with a branch never taken</p>"
    )
    return _page(f"{file.name}: {title}", heading + f"<table class='source'>{''.join(body)}</table>")


def _page(title: str, body: str) -> str:
    style = (
        "body{font-family:sans-serif}pre{margin:0}td.n{color:#888;text-align:right;padding-right:1em}"
        ".hit{background:#dfd}.miss{background:#fdd}.partial{background:#ffc}.note{color:#a60}"
        "table{border-collapse:collapse}th,td{padding:0 .5em;text-align:left}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body>{body}</body></html>\n"
    )


def short_name(path: str) -> str:
    """A file's name in a table: the display name without its engine package's ``vllm/`` or ``sglang/``."""
    return re.sub(r"^(vllm|sglang)/", "", display_name(path))
