"""The coverage measurer (kvfuzz.coverage): on a small module written here, a call reaches exactly the lines and
branches listed by hand below, on this interpreter's measurer (sys.settrace on 3.11, sys.monitoring on 3.12+); the
file's static points; and the HTML report."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from kvfuzz.coverage.measure import Reached, TraceMeasurer, measurer
from kvfuzz.coverage.report import summarize, write_html
from kvfuzz.coverage.static import file_points

SOURCE = """\
import functools


def classify(n):
    if n > 0:
        kind = "positive"
    elif n < 0:
        kind = "negative"
    else:
        kind = "zero"
    return kind


def total(items):
    result = 0
    for item in items:
        result += item
    return result


@functools.lru_cache(maxsize=None)
def decorated(x):
    return x * 2


class Box:
    size = 3

    def grow(self, by):
        while by > 0:
            self.size += 1
            by -= 1
        return self.size
"""
"""Line numbers below are this text's. The module's and the class's bodies (lines 1, 4, 14, 21-22, 26-27, 29) run at
import and are not measured; a function's first line (its ``def``, or its first decorator) counts when it is
entered."""

FUNCTION_LINES = {4, 5, 6, 7, 8, 10, 11, 14, 15, 16, 17, 18, 21, 23, 29, 30, 31, 32, 33}
BRANCHES = {(5, 6), (5, 7), (7, 8), (7, 10), (16, 17), (16, 18), (30, 31), (30, 33)}


def _module(tmp_path: Path) -> ModuleType:
    path = tmp_path / "kvfuzz_coverage_sample.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("kvfuzz_coverage_sample", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reached(module: ModuleType, call: object) -> tuple[set[int], set[tuple[int, int]]]:
    measure = measurer([module.__file__])
    measure.start()
    try:
        call()  # type: ignore[operator]
    finally:
        measure.stop()
    reached = measure.take()
    assert {path for path, _ in reached.lines} <= {str(Path(module.__file__).resolve())}
    return {line for _, line in reached.lines}, {(start, end) for _, start, end in reached.branches}


def test_the_files_points_are_its_functions_lines_and_branches(tmp_path: Path) -> None:
    module = _module(tmp_path)
    points = file_points(module.__file__)
    assert points is not None
    assert set(points.lines) == FUNCTION_LINES
    assert set(points.branches) == BRANCHES


def test_a_call_reaches_exactly_the_lines_and_branches_it_runs(tmp_path: Path) -> None:
    module = _module(tmp_path)
    lines, branches = _reached(module, lambda: module.classify(1))
    assert lines == {4, 5, 6, 11}
    assert branches == {(5, 6)}


def test_loops_and_the_other_branches(tmp_path: Path) -> None:
    module = _module(tmp_path)
    lines, branches = _reached(module, lambda: (module.classify(0), module.total([1, 2]), module.Box().grow(2)))
    assert lines == {4, 5, 7, 10, 11, 14, 15, 16, 17, 18, 29, 30, 31, 32, 33}
    assert branches == {(5, 7), (7, 10), (16, 17), (16, 18), (30, 31), (30, 33)}


def test_a_decorated_function_counts_from_its_decorator_line(tmp_path: Path) -> None:
    module = _module(tmp_path)
    lines, branches = _reached(module, lambda: module.decorated(3))
    assert lines == {21, 23}
    assert branches == set()


def test_each_point_is_reported_once_and_code_outside_the_files_is_not_measured(tmp_path: Path) -> None:
    module = _module(tmp_path)
    measure = measurer([module.__file__])
    measure.start()
    module.classify(1)
    first = measure.take()
    module.classify(1)
    again = measure.take()
    module.classify(-1)
    measure.stop()
    other = measure.take()
    assert len(first) == 5 and not again
    assert {line for _, line in other.lines} == {7, 8} and {b[1:] for b in other.branches} == {(5, 7), (7, 8)}


def test_the_tracer_stops_tracing_a_function_once_every_point_was_reached(tmp_path: Path) -> None:
    module = _module(tmp_path)
    measure = TraceMeasurer([module.__file__])
    measure.start()
    module.decorated.__wrapped__(1)  # every point of decorated(): its two lines
    measure.stop()
    code = module.decorated.__wrapped__.__code__
    assert code in measure.points.codes and measure.points.codes[code] is None  # not traced any more


def test_the_measurer_is_the_cheapest_the_interpreter_has() -> None:
    """sys.monitoring where CPython has it (3.12+), the tracer before; .ci/run runs this file on 3.11, 3.12 and 3.13,
    so both measurers pass the tests above."""
    expected = "MonitoringMeasurer" if sys.version_info >= (3, 12) else "TraceMeasurer"
    assert type(measurer([])).__name__ == expected


def test_the_summary_and_the_html_report(tmp_path: Path) -> None:
    module = _module(tmp_path)
    path = str(Path(module.__file__).resolve())
    reached = Reached(frozenset({(path, 4), (path, 5), (path, 6), (path, 11)}), frozenset({(path, 5, 6)}))
    summary = summarize(reached, [path])
    (row,) = summary.files
    assert (row.lines_reached, row.lines, row.branches_reached, row.branches) == (4, 19, 1, 8)
    assert round(summary.percent, 1) == round(100 * 5 / 27, 1)
    index = write_html(tmp_path / "html", reached, [path], "test")
    page = (tmp_path / "html" / "file0.html").read_text()
    assert "4 of 19 lines" in index.read_text()
    assert "<tr class='partial'><td class='n'>5</td>" in page  # reached, its branch to line 7 never taken
    assert "never to line 7" in page
    assert "<tr class='miss'><td class='n'>7</td>" in page
    assert "<tr class='hit'><td class='n'>6</td>" in page
