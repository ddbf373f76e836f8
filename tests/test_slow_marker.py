"""The suite's --slow option: tests marked slow are skipped by a plain ``pytest`` with a reason that says how to run
them, ``pytest --slow`` runs everything and ``pytest --slow -m slow`` only them (the second step of ``.ci/run``)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parent / "conftest.py"

TESTS = """
import pytest

def test_quick():
    pass

@pytest.mark.slow
def test_long():
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    """A suite of one quick and one slow test, under this suite's conftest and marker registration."""
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow tests\naddopts = --strict-markers\n")
    pytester.makepyfile(test_suite=TESTS)
    return pytester


def test_a_plain_run_skips_the_slow_tests_and_says_how_to_run_them(suite: pytest.Pytester) -> None:
    result = suite.runpytest_inprocess("-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(
        ["SKIPPED *test_suite.py:*: slow: pytest --slow runs everything, pytest --slow -m slow only the slow tests"]
    )


def test_slow_runs_everything_and_slow_m_slow_only_the_slow_tests(suite: pytest.Pytester) -> None:
    suite.runpytest_inprocess("--slow").assert_outcomes(passed=2)
    only = suite.runpytest_inprocess("--slow", "-m", "slow", "-v")
    only.assert_outcomes(passed=1, deselected=1)
    only.stdout.fnmatch_lines(["*test_long PASSED*"])


def test_the_project_registers_the_slow_marker() -> None:
    pyproject = (CONFTEST.parent.parent / "pyproject.toml").read_text()
    assert '"slow: ' in pyproject
