"""benchmarks/independent: the correct base passes kvfuzz's run, and kvfuzz catches every one-bug variant.

The variants were written from bug reports and the contract alone (see the package's docstring). Each test runs
what ``kvfuzz run`` runs (``kvfuzz.runner.run``, default pool, shrinking off) and stops at the first failure, so a
caught variant costs only the time to find it (all of them together take seconds, so none is marked slow); a variant
kvfuzz stopped catching would run its whole budget and fail.
"""

from __future__ import annotations

import pytest

from benchmarks.independent import BUGS, Bug
from benchmarks.independent.base import factory as base_factory
from kvfuzz.program.failures import Hang
from kvfuzz.runner import run

# The budget each variant gets: 1000 examples under seed 1. The default run (100 examples) misses two variants on
# some seeds (CopyOnWriteForForksOnly, RollbackKeepsPartialDigest: see python -m benchmarks.independent.detect).
EXAMPLES = 1000
BY_NAME = {bug.name: bug for bug in BUGS}


def caught(bug: Bug) -> None:
    summary = run(bug.factory, examples=EXAMPLES, seed=1, shrink=False, allocator_name=bug.spec)
    assert summary.failed, f"kvfuzz missed {bug.name} in {summary.examples} examples: {bug.report}"
    assert not isinstance(summary.kind, Hang), f"{bug.name} hung: {summary.invariant}"


def test_base_passes_a_short_run() -> None:
    summary = run(base_factory, examples=60, seed=1, shrink=False)
    assert not summary.failed, f"{summary.invariant}\n{summary.program}\n{summary.explanation}"
    assert summary.examples == 60


def test_bugs_are_distinct_and_named_after_their_factories() -> None:
    assert len(BUGS) >= 18
    assert len({bug.name for bug in BUGS}) == len(BUGS)
    for bug in BUGS:
        assert getattr(bug.factory, "__name__", None) == bug.name
        assert "\n" not in bug.report and bug.report.endswith(".")


@pytest.mark.parametrize("name", list(BY_NAME))
def test_every_variant_is_caught(name: str) -> None:
    caught(BY_NAME[name])
