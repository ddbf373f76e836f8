"""The comparison of two coverage measurements (kvfuzz.coverage.compare, scripts/coverage_compare.py): figures
counted by hand on a two-function file measured in two environments."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kvfuzz.coverage.compare import ComparisonError, Measurement, compare, package_path
from kvfuzz.coverage.scope import LEFT_OUT, LeftOut
from kvfuzz.coverage.static import function_points, guarded_lines

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import coverage_compare  # noqa: E402

SOURCE = "def f(x):\n    return x\n\n\ndef g(x):\n    if x:\n        x = 1\n    return x\n"
# f: lines 1, 2; g: lines 5, 6, 7, 8 and branches (6, 7), (6, 8): 2 + 4 + 2 = 8 points


def copy(root: Path, environment: str, source: str = SOURCE) -> str:
    path = root / environment / "lib" / "site-packages" / "pkg" / "m.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return str(path)


def points(path: str, lines: list[int], branches: list[list[int]]) -> dict[str, Any]:
    return {path: {"lines": lines, "branches": branches}}


def test_each_sides_figures_their_union_and_what_each_reached_alone(tmp_path: Path) -> None:
    first, second = copy(tmp_path, "tests-env"), copy(tmp_path, "campaign-env")
    tests = Measurement.from_json("tests", {"points": points(first, [1, 2], [])})
    campaign = Measurement.from_json("campaign", {"coverage": {"points": points(second, [2, 5, 6, 7], [[6, 7]])}})
    (row,) = compare(tests, campaign, ["pkg/m.py"]).files
    assert (row.name, row.points, row.tests, row.campaign, row.union) == ("pkg/m.py", 8, 2, 5, 6)
    assert (row.tests_only, row.campaign_only) == (1, 4)
    assert row.percent(row.union) == 75.0


def test_a_function_left_out_counts_for_neither_side(tmp_path: Path) -> None:
    path = copy(tmp_path, "env")
    tests = Measurement.from_json("tests", {"points": points(path, [1, 2, 5, 6, 8], [[6, 8]])})
    campaign = Measurement.from_json("campaign", {"points": points(path, [5], [])})
    result = compare(tests, campaign, ["pkg/m.py"], {"pkg/m.py": LeftOut(functions=("g",))})
    (row,) = result.files
    assert (row.points, row.tests, row.campaign) == (2, 2, 0)
    assert result.left_out == ("pkg/m.py: g",)
    (gap,) = result.widest_gaps(5)
    assert (gap.qualname, gap.tests, gap.campaign) == ("f", 2, 0)


GUARDED = """\
def h(request, x):
    if request.mm:
        x = 1
    if not request.mm:
        x = 2
    if (
        x > 0
        and request.mm is not None
        and request.mm.ready()
    ):
        x = 3
    elif x or request.mm:
        x = 4
    return x
"""
# guarded by "mm": line 3 (under ``if request.mm``), lines 9 to 11 (the condition's lines after ``request.mm is not
# None``, and the block); not line 5 (a negation), not the ``elif`` (a disjunction with a term that needs no
# guard), not the ``if`` lines nor ``x > 0``


def test_the_lines_a_guard_guards_are_those_that_run_only_when_it_is_set(tmp_path: Path) -> None:
    path = tmp_path / "g.py"
    path.write_text(GUARDED)
    assert guarded_lines(str(path), frozenset({"mm"})) == {3, 9, 10, 11}
    assert guarded_lines(str(path), frozenset()) == frozenset()
    path.write_text("def k(a, b):\n    if a.mm or b.mm:\n        return 1\n    if a.mm is None:\n        return 2\n")
    assert guarded_lines(str(path), frozenset({"mm"})) == {3}  # every term needs it; ``is None`` does not


def test_guarded_code_counts_for_neither_side(tmp_path: Path) -> None:
    path = copy(tmp_path, "env", "def g(x):\n    if x.mm:\n        x = 1\n    return x\n")
    # lines 1, 2, 3, 4 and branches (2, 3), (2, 4): 6 points; guarded: line 3 and the branch into it
    tests = Measurement.from_json("tests", {"points": points(path, [1, 2, 3, 4], [[2, 3], [2, 4]])})
    campaign = Measurement.from_json("campaign", {"points": points(path, [1, 2, 4], [[2, 4]])})
    result = compare(tests, campaign, ["pkg/m.py"], {"pkg/m.py": LeftOut(guards=frozenset({"mm"}))})
    (row,) = result.files
    assert (row.points, row.tests, row.campaign, row.tests_only) == (4, 4, 4, 0)
    assert result.guarded == ("pkg/m.py: lines 3 (2 points)",)
    (kept,) = compare(tests, campaign, ["pkg/m.py"]).files
    assert (kept.points, kept.tests, kept.campaign) == (6, 6, 4)


def test_vllms_encoder_guards_leave_the_chunked_prefill_off_stop_in(tmp_path: Path) -> None:
    """The negated encoder guard beside chunked prefill off (``and not self.is_mm_encoder_only``) guards nothing:
    text-only requests take that branch, and kvfuzz drives it."""
    left_out = LEFT_OUT["vllm-v1"]["vllm/v1/core/sched/scheduler.py"]
    source = (
        "def schedule(self, request):\n"
        "    if (\n"
        "        not self.scheduler_config.enable_chunked_prefill\n"
        "        and not self.is_mm_encoder_only\n"
        "    ):\n"
        "        return 1\n"
        "    if request.has_encoder_inputs:\n"
        "        return 2\n"
    )
    path = tmp_path / "s.py"
    path.write_text(source)
    assert guarded_lines(str(path), left_out.guards) == {8}


def test_functions_are_named_as_python_names_them(tmp_path: Path) -> None:
    path = tmp_path / "n.py"
    path.write_text("class C:\n    def m(self):\n        def inner():\n            return 1\n        return inner\n")
    found = function_points(str(path))
    assert found is not None
    assert [function.qualname for function in found] == ["C.m", "C.m.<locals>.inner"]


def test_two_different_copies_are_refused(tmp_path: Path) -> None:
    first, second = copy(tmp_path, "one"), copy(tmp_path, "two", SOURCE + "\n\ndef h():\n    pass\n")
    tests = Measurement.from_json("tests", {"points": points(first, [1], [])})
    campaign = Measurement.from_json("campaign", {"points": points(second, [1], [])})
    with pytest.raises(ComparisonError, match="different sources"):
        compare(tests, campaign, ["pkg/m.py"])


def test_a_campaign_json_without_coverage_is_refused() -> None:
    with pytest.raises(ComparisonError, match="needs --coverage"):
        Measurement.from_json("the campaign", {"scheduler": "vllm-v1", "steps": 10})


def test_a_file_is_named_inside_its_package() -> None:
    path = "/x/venv/lib/python3.11/site-packages/vllm/v1/core/block_pool.py"
    assert package_path(path) == "vllm/v1/core/block_pool.py"


def test_the_script_prints_the_table_and_refuses_bad_input_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = copy(tmp_path, "env")
    (tmp_path / "tests.json").write_text(json.dumps({"points": points(path, [1, 2, 5], [])}))
    (tmp_path / "campaign.json").write_text(json.dumps({"coverage": {"points": points(path, [5, 6, 7], [[6, 7]])}}))
    status = coverage_compare.main([str(tmp_path / "tests.json"), str(tmp_path / "campaign.json"), "--all-files"])
    out = capsys.readouterr().out
    assert status == 0
    assert "pkg/m.py" in out and "37.5%" in out and "50.0%" in out  # tests 3/8, campaign 4/8
    (tmp_path / "empty.json").write_text("{}")
    status = coverage_compare.main([str(tmp_path / "tests.json"), str(tmp_path / "empty.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "holds no points" in err[0]
