"""Enablement kept across calls: the expected state's index of the sequences (its census) and a snapshot's answers
(every gating query, every pick's options, random programs' enabled list) outlive the calls that changed nothing they
read. Over thousands of states random programs reach, in several configurations, every kept answer is compared after
every call with the same answer recomputed from scratch (the state's own passes over its sequences); and a transition
that forgets to tell the state (a seeded stale-index bug) is caught by that comparison."""

from __future__ import annotations

import random
from typing import Any, Callable, Iterator

import pytest
from test_operations import CENSUS_CONFIGS

from kvfuzz.engine.arguments import BlockIds, CensusSnapshot, Pick, Snapshot, snapshot_of
from kvfuzz.engine.expected import ExpectedState, Status
from kvfuzz.engine.features.host_tier import AsyncLoading
from kvfuzz.engine.operation import Enablement, Operation
from kvfuzz.program.execution import Target
from kvfuzz.program.operations import OPERATIONS
from kvfuzz.reference.contiguous import ContiguousReference


def stale_answers(kept: CensusSnapshot, state: ExpectedState, enablement: Enablement) -> list[str]:
    """Every answer ``kept`` gives (or its state's census) that differs from the same answer recomputed from scratch:
    the state's own passes over its sequences, through a plain :class:`Snapshot` made now."""
    fresh = Snapshot(state)
    census = state.census()
    found = []

    def compare(what: str, incremental: Any, scratch: Any) -> None:
        if list(incremental) != list(scratch):
            found.append(f"{what}: kept {list(incremental)}, from scratch {list(scratch)}")

    for status in Status:
        compare(f"census {status.name}", census.by_status[status], state.ids(status))
        compare(f"ids({status.name})", kept.ids(status), state.ids(status))
    compare("census live", census.live, state.live_ids())
    compare("census computed", census.computed, state.computed_ids())
    for operation in OPERATIONS:
        for name, argument in operation.arguments:
            if isinstance(argument, BlockIds):
                compare(f"{operation.name} {name}", argument.options(kept), argument.options(fresh))
            elif isinstance(argument, Pick):  # a FilledPick too: the misuse calls, namespaces, system prompts
                compare(f"{operation.name} {name}", kept.options(argument.options), argument.options(fresh))
    enabled = kept.kept(enablement, lambda: enablement.enabled(kept))
    declared = [operation for operation, _ in enablement.operations]
    compare("enabled", [op.name for op, _ in enabled], [op.name for op in declared if op.enabled(state)])
    return found


def checked_programs(name: str, programs: int, length: int, seed: int) -> Iterator[tuple[list[str], bool]]:
    """Random programs on ``name``'s configuration, drawn as ``random_program`` draws them (one snapshot renewed
    before each call, the enabled list of an :class:`Enablement` kept in it): before every call, the stale answers
    found and whether the snapshot kept its answers from the previous call."""
    factory, config = CENSUS_CONFIGS[name]
    target, rng = Target(factory, config), random.Random(seed)
    for _ in range(programs):
        execution = target.start()
        state = execution.engine.expected
        snapshot = snapshot_of(state)
        assert isinstance(snapshot, CensusSnapshot)
        enablement = Enablement([(operation, 1.0) for operation in OPERATIONS if operation.declared(state.caps)])
        for _ in range(length):
            answers = snapshot._answers.copy()
            snapshot.renewed()
            reused = bool(answers) and snapshot._answers == answers
            yield stale_answers(snapshot, state, enablement), reused
            enabled: list[tuple[Operation, float]] = snapshot.kept(enablement, lambda: [])
            operation = rng.choice(enabled)[0]
            execution.execute(operation.name, operation.draw(snapshot, rng))
        execution.teardown()


@pytest.mark.parametrize("name", sorted(CENSUS_CONFIGS))
def test_kept_answers_equal_a_recomputation_after_every_call(name: str) -> None:
    states = reused = 0
    for stale, kept in checked_programs(name, programs=25, length=40, seed=11):
        assert not stale, stale
        states += 1
        reused += kept
    assert states == 1000
    assert reused, "no call ever kept the previous answers: the reuse path went untested"


def _first_stale(name: str) -> list[str]:
    for stale, _ in checked_programs(name, programs=25, length=40, seed=11):
        if stale:
            return stale
    return []


def _silenced(method: Callable[..., Any], attribute: str) -> Callable[..., Any]:
    """``method`` with its object's ``attribute`` (a listener) switched off while it runs: a transition that forgets
    to tell the state."""

    def forgetting(self: Any, *args: Any) -> Any:
        listener = getattr(self, attribute)
        setattr(self, attribute, lambda *told: None)
        try:
            return method(self, *args)
        finally:
            setattr(self, attribute, listener)

    return forgetting


def test_a_grow_that_forgets_to_tell_the_state_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded stale-index bug: the reference's ``extend`` changes a sequence's tokens without telling the state, so a
    grown sequence keeps its index entry (computed) while it has tokens no step wrote."""
    assert not _first_stale("paged")
    monkeypatch.setattr(ContiguousReference, "extend", _silenced(ContiguousReference.extend, "on_change"))
    stale = _first_stale("paged")
    assert any(line.startswith("census computed") for line in stale), stale


def test_a_load_that_becomes_landable_unannounced_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded stale-cache bug: an asynchronous load becomes landable at a step's completion without telling the
    state, so a step that changed no sequence leaves ``land_loads`` disabled though a load may now be reported."""
    assert not _first_stale("asynchronous host tier")

    def landable_unannounced(self: AsyncLoading, completion: Any) -> None:
        for load in self.loads.values():
            load.landable = load.landable or (load.launched_at is not None and load.launched_at <= completion.step)

    monkeypatch.setattr(AsyncLoading, "landable", landable_unannounced)
    stale = _first_stale("asynchronous host tier")
    assert any("land_loads" in line or line.startswith("enabled") for line in stale), stale
