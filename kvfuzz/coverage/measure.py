"""Measuring which lines and branches of the code under test a process reaches (:mod:`kvfuzz.coverage.static` says
what a line and a branch are).

Two measurers report the same points:

* :class:`MonitoringMeasurer` (CPython 3.12 and later): ``sys.monitoring``'s ``PY_START``, ``LINE`` and ``BRANCH``
  events. A location that has fired is disabled (a conditional jump once both its directions have), and every
  location outside the measured files is disabled the first time it fires, so code already covered runs at full
  speed;
* :class:`TraceMeasurer` (CPython 3.11, the engines' interpreter): a ``sys.settrace`` tracer that traces only the
  functions of the measured files, and stops tracing a function once every one of its points was reached.

Each point is reported once, the first time it is reached: :meth:`Measurer.take` returns the points first reached
since the previous take. Neither measurer sees kvfuzz's own code unless a measured file is kvfuzz's.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Collection, Iterable
from types import CodeType, FrameType
from typing import Any, Callable, Optional, Protocol

import attrs

from kvfuzz.coverage.static import Branch, CodePoints, code_points, is_function

Line = tuple[str, int]
"""(file, line)."""
FileBranch = tuple[str, int, int]
"""(file, the jump's line, the line the direction lands on)."""


@attrs.frozen
class Reached:
    """Points reached: lines and branches, each named with its file's real path."""

    lines: frozenset[Line] = frozenset()
    branches: frozenset[FileBranch] = frozenset()

    def __len__(self) -> int:
        return len(self.lines) + len(self.branches)

    def __or__(self, other: Reached) -> Reached:
        return Reached(self.lines | other.lines, self.branches | other.branches)

    def __sub__(self, other: Reached) -> Reached:
        return Reached(self.lines - other.lines, self.branches - other.branches)

    def to_json(self) -> dict[str, Any]:
        """Points grouped by file: ``{file: {"lines": [...], "branches": [[from, to], ...]}}``, sorted."""
        files: dict[str, dict[str, list[Any]]] = {}
        for path, line in sorted(self.lines):
            files.setdefault(path, {"lines": [], "branches": []})["lines"].append(line)
        for path, start, end in sorted(self.branches):
            files.setdefault(path, {"lines": [], "branches": []})["branches"].append([start, end])
        return files

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Reached:
        lines = {(str(path), int(line)) for path, points in data.items() for line in points.get("lines", ())}
        branches = {
            (str(path), int(start), int(end))
            for path, points in data.items()
            for start, end in points.get("branches", ())
        }
        return cls(frozenset(lines), frozenset(branches))


class Measurer(Protocol):
    """Measures the points of a set of files in this process."""

    def start(self) -> None:
        """Start (or resume) measuring: idempotent."""

    def stop(self) -> None:
        """Stop measuring; the points reached so far stay to be taken."""

    def take(self) -> Reached:
        """The points first reached since the previous take."""


def real(path: str) -> str:
    return os.path.realpath(path)


@attrs.define
class _Code:
    """A measured function's points not reached yet."""

    path: str
    points: CodePoints
    lines: set[int]
    branches: set[Branch]
    directions: dict[int, set[int]] = attrs.Factory(dict)  # jump offset -> the landing offsets seen (monitoring)

    @property
    def done(self) -> bool:
        return not self.lines and not self.branches


class _Points:
    """The bookkeeping both measurers share: which code objects are measured, and the points reached."""

    def __init__(self, files: Iterable[str]) -> None:
        self.files = frozenset(real(path) for path in files)
        self._paths: dict[str, Optional[str]] = {}  # co_filename -> its real path when measured, else None
        self.codes: dict[CodeType, Optional[_Code]] = {}  # None: not measured, or every point reached
        self.lines: list[Line] = []
        self.branches: list[FileBranch] = []
        self.lock = threading.Lock()

    def code(self, code: CodeType) -> Optional[_Code]:
        try:
            return self.codes[code]
        except KeyError:
            pass
        name = code.co_filename
        if name not in self._paths:
            self._paths[name] = real(name) if real(name) in self.files else None
        path = self._paths[name]
        state = None
        if path is not None and is_function(code):
            points = code_points(code)
            state = _Code(path, points, set(points.lines), set(points.branches))
        self.codes[code] = state
        return state

    def line(self, code: CodeType, state: _Code, line: int) -> None:
        if line in state.lines:
            state.lines.discard(line)
            self.lines.append((state.path, line))
            self._retire(code, state)

    def branch(self, code: CodeType, state: _Code, branch: Branch) -> None:
        if branch in state.branches:
            state.branches.discard(branch)
            self.branches.append((state.path, *branch))
            self._retire(code, state)

    def _retire(self, code: CodeType, state: _Code) -> None:
        if state.done:
            self.codes[code] = None

    def take(self) -> Reached:
        with self.lock:
            lines, self.lines = self.lines, []
            branches, self.branches = self.branches, []
        return Reached(frozenset(lines), frozenset(branches))


class TraceMeasurer:
    """``sys.settrace`` (and ``threading.settrace``) on the functions of ``files``; see the module."""

    def __init__(self, files: Collection[str]) -> None:
        self.points = _Points(files)
        self._running = False

    def start(self) -> None:
        if sys.gettrace() is not self._call:  # another tracer (a debugger) took over: ours again
            sys.settrace(self._call)
        threading.settrace(self._call)
        self._running = True

    def stop(self) -> None:
        if sys.gettrace() is self._call:
            sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]  # None unsets it, as for sys.settrace
        self._running = False

    def take(self) -> Reached:
        return self.points.take()

    def _call(self, frame: FrameType, event: str, arg: Any) -> Optional[Callable[..., Any]]:
        code = frame.f_code
        points = self.points
        state = points.code(code)
        if state is None:
            return None
        points.line(code, state, code.co_firstlineno)
        lines, branches = state.lines, state.branches
        last = -1

        def local(frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
            nonlocal last
            if event == "line":
                line = frame.f_lineno
                if line in lines:
                    points.line(code, state, line)
                if (last, line) in branches:
                    points.branch(code, state, (last, line))
                last = line
            return local

        return local


class MonitoringMeasurer:
    """``sys.monitoring`` (CPython 3.12+) on the functions of ``files``; see the module."""

    def __init__(self, files: Collection[str]) -> None:
        self.points = _Points(files)
        self.tool: Optional[int] = None

    def start(self) -> None:
        if self.tool is not None:
            return
        monitoring: Any = getattr(sys, "monitoring")  # noqa: B009 -- absent before 3.12, where this is never made
        events = monitoring.events
        free = [tool for tool in (monitoring.COVERAGE_ID, 5, 4, 3, 2, 0) if monitoring.get_tool(tool) is None]
        if not free:
            raise RuntimeError("every sys.monitoring tool id is taken: coverage cannot be measured")
        self.tool = tool = free[0]
        monitoring.use_tool_id(tool, "kvfuzz coverage")
        monitoring.register_callback(tool, events.PY_START, self._start)
        monitoring.register_callback(tool, events.LINE, self._line)
        monitoring.register_callback(tool, events.BRANCH, self._branch)
        monitoring.set_events(tool, events.PY_START | events.LINE | events.BRANCH)

    def stop(self) -> None:
        if self.tool is None:
            return
        monitoring: Any = getattr(sys, "monitoring")  # noqa: B009
        events = monitoring.events
        monitoring.set_events(self.tool, 0)
        for event in (events.PY_START, events.LINE, events.BRANCH):
            monitoring.register_callback(self.tool, event, None)
        monitoring.free_tool_id(self.tool)
        self.tool = None

    def take(self) -> Reached:
        return self.points.take()

    def _start(self, code: CodeType, offset: int) -> Any:
        state = self.points.code(code)
        if state is not None:
            self.points.line(code, state, code.co_firstlineno)
        return getattr(sys, "monitoring").DISABLE  # noqa: B009

    def _line(self, code: CodeType, line: int) -> Any:
        state = self.points.code(code)
        if state is not None:
            self.points.line(code, state, line)
        return getattr(sys, "monitoring").DISABLE  # noqa: B009

    def _branch(self, code: CodeType, offset: int, destination: int) -> Any:
        disable = getattr(sys, "monitoring").DISABLE  # noqa: B009
        state = self.points.code(code)
        jump = state.points.jumps.get(offset) if state is not None else None
        if state is None or jump is None:
            return disable
        line, following, fall, target = jump
        landing = fall if destination == following else target
        if landing is not None:
            self.points.branch(code, state, (line, landing))
        seen = state.directions.setdefault(offset, set())
        seen.add(destination == following)
        return disable if len(seen) == 2 else None


def measurer(files: Collection[str]) -> Measurer:
    """The cheapest measurer this interpreter has for ``files``."""
    if hasattr(sys, "monitoring"):
        return MonitoringMeasurer(files)
    return TraceMeasurer(files)
