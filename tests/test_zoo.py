"""Every broken allocator in the zoo is caught, and named by the invariant its slip breaks."""

from __future__ import annotations

import pytest

from kvfuzz.runner import run
from kvfuzz.statemachines import MachineConfig
from kvfuzz.zoo import VARIANTS, variant

BUG_CLASSES_COVERED = {name.split()[0] for name in (v.bug_class for v in VARIANTS) if name[0].isdigit()}


@pytest.mark.parametrize("broken", VARIANTS, ids=lambda v: v.name)
def test_variant_is_caught_with_the_expected_invariant(broken) -> None:
    summary = run(broken.factory(), MachineConfig(), examples=2000, steps=50, shrink=False)
    assert summary.failed, f"{broken.name} escaped {summary.examples} examples"
    assert summary.violated is broken.expected, summary.explanation


@pytest.mark.parametrize("name", ["KeyWithoutNamespace", "NoCopyOnWrite", "LeakyRefusal"])
def test_shrunk_program_is_short_and_explained(name) -> None:
    broken = variant(name)
    summary = run(broken.factory(), MachineConfig(), examples=600, steps=50)
    assert summary.violated is broken.expected, summary.explanation
    assert 1 <= summary.program_length <= 10, summary.program
    assert summary.program.startswith("state = ") and "state.teardown()" in summary.program
    assert str(broken.expected) in summary.explanation and "expected" in summary.explanation


def test_zoo_covers_the_design_bug_classes() -> None:
    assert {str(number) for number in range(1, 12)} <= BUG_CLASSES_COVERED
    assert len(VARIANTS) >= 16
