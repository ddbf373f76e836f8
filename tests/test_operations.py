"""The operation table is the one place enablement and validity are written: over thousands of states reached by
random programs, replay accepts exactly the calls the machine could have drawn."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import pytest
from factories import lookahead_with_drafts
from hypothesis.stateful import run_state_machine_as_test
from test_async_loads import AsyncHostTierAllocator

from examples.simple_allocator import make_allocator as simple_allocator
from kvfuzz.allocator import paged_allocator, synchronous_allocator
from kvfuzz.allocator.paged import sliding_window_allocator
from kvfuzz.engine import MachineConfig, MisuseCall
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Execution, Target
from kvfuzz.program.operations import BY_NAME, CORE, OPERATIONS, assembled
from kvfuzz.runner import run_settings
from kvfuzz.statemachines import machine_for

CONFIGS = {
    "paged": (paged_allocator, MachineConfig(num_blocks=8, num_host_blocks=4)),
    "synchronous, no host pool": (synchronous_allocator, MachineConfig(num_blocks=8, num_host_blocks=0)),
    "sliding window": (sliding_window_allocator, MachineConfig(num_blocks=8, num_host_blocks=2)),
    "simple (rollback only)": (simple_allocator, MachineConfig(num_blocks=8, num_host_blocks=0)),
    "look-ahead, drafts only": (lookahead_with_drafts, MachineConfig(num_blocks=10, num_host_blocks=4)),
    "asynchronous host tier": (AsyncHostTierAllocator, MachineConfig(block_size=4, num_blocks=8, num_host_blocks=4)),
}


def _states(target: Target, rng: random.Random, programs: int, length: int):
    """Every state random programs reach on a correct allocator (each yielded before the next call is made)."""
    for _ in range(programs):
        execution = target.start()
        for _ in range(length):
            yield execution
            state = execution.engine.expected
            operation = rng.choice([operation for operation in OPERATIONS if operation.enabled(state)])
            execution.execute(operation.name, operation.draw(state, rng))
        execution.teardown()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_replay_accepts_exactly_what_the_machine_could_draw(name: str) -> None:
    factory, config = CONFIGS[name]
    rng = random.Random(1)
    seen: dict[str, list[dict[str, Any]]] = defaultdict(list)  # arguments drawn for each operation, in any state
    states = enabled_somewhere = 0
    disabled_rejected: set[str] = set()
    for execution in _states(Target(factory, config), rng, programs=40, length=40):
        states += 1
        state = execution.engine.expected
        for operation in OPERATIONS:
            if operation.enabled(state):
                enabled_somewhere += 1
                drawn = operation.draw(state, rng)
                assert execution.accepts(Call(operation.name, drawn)), (operation.name, drawn)
                seen[operation.name].append(drawn)
            else:
                # Arguments that were valid in some other state are refused in a state where the rule is disabled.
                for arguments in seen[operation.name][-5:]:
                    assert not execution.accepts(Call(operation.name, arguments)), (operation.name, arguments)
                    disabled_rejected.add(operation.name)
    assert states == 1600 and enabled_somewhere > states
    assert disabled_rejected, "no disabled operation was ever tried"


def test_every_operation_is_enabled_somewhere_for_allocators_that_declare_everything() -> None:
    """kvfuzz's allocator declares every capability but a host tier; the asynchronous host tier brings the rest."""
    enabled: set[str] = set()
    for name in ("paged", "asynchronous host tier"):
        factory, config = CONFIGS[name]
        for execution in _states(Target(factory, config), random.Random(2), programs=40, length=40):
            enabled |= {operation.name for operation in OPERATIONS if operation.enabled(execution.engine.expected)}
    assert enabled == set(BY_NAME)


def _fresh(factory=paged_allocator, config: MachineConfig = MachineConfig()) -> Execution:
    return Target(factory, config).start()


def test_the_drifts_replay_used_to_accept_are_refused() -> None:
    """Each call below was accepted by replay while the machine could never have drawn it."""
    execution = _fresh()
    assert not execution.accepts(Call("evict", {"num_blocks": 1}))  # needs a finished sequence
    assert not execution.accepts(Call("reset_cache", {}))
    assert not execution.accepts(Call("misuse", {"call": MisuseCall("grow", ("nobody", (1,)), "nobody")}))
    assert not execution.accepts(Call("frobnicate", {}))  # no such operation
    assert execution.accepts(Call("admit", {"seq": "s0", "namespace": (), "system": (), "suffix": [1]}))
    execution.execute("admit", {"seq": "s0", "namespace": (), "system": (), "suffix": [1]})
    execution.execute("step", {})
    assert not execution.accepts(Call("admit", {"seq": "s0", "namespace": (), "system": (), "suffix": [1]}))
    assert not execution.accepts(Call("grow", {"seq": "s0", "tokens": [9]}))  # outside the vocabulary
    assert not execution.accepts(Call("grow", {"seq": "s0"}))  # an argument missing
    assert not execution.accepts(Call("fork", {"parent": "s0", "child": "s0"}))
    without_host = _fresh(config=MachineConfig(num_host_blocks=0))
    without_host.execute("admit", {"seq": "s0", "namespace": (), "system": (), "suffix": [1]})
    without_host.execute("step", {})
    assert not without_host.accepts(Call("swap_out", {"seq": "s0"}))  # no host pool to swap to


def test_the_machine_has_one_rule_per_operation_and_the_table_enables_them() -> None:
    machine_class = machine_for(paged_allocator)
    rules = {rule.function.__name__: rule for rule in machine_class.setup_state().rules}
    assert set(rules) == set(BY_NAME)
    machine = machine_class()
    # Hypothesis's preconditions agree with the table's enablement, state after state.
    rng = random.Random(3)
    for _ in range(300):
        state = machine.expected
        for operation in OPERATIONS:
            precondition_holds = all(precondition(machine) for precondition in rules[operation.name].preconditions)
            assert precondition_holds == operation.enabled(state), operation.name
        operation = rng.choice([operation for operation in OPERATIONS if operation.enabled(state)])
        machine.execution.execute(operation.name, operation.draw(state, rng))
    machine.teardown()


@pytest.mark.slow
def test_every_call_hypothesis_draws_is_one_replay_accepts(monkeypatch) -> None:
    """The strategies the machine's rules draw from, and replay's validity, come from one description."""
    checked: list[str] = []
    original = Execution.execute

    def execute(self: Execution, name: str, arguments: dict[str, Any]) -> None:
        assert self.accepts(Call(name, arguments)), (name, arguments)
        checked.append(name)
        original(self, name, arguments)

    monkeypatch.setattr(Execution, "execute", execute)
    run_state_machine_as_test(machine_for(paged_allocator), settings=run_settings(60, 40))
    factory, config = CONFIGS["asynchronous host tier"]
    run_state_machine_as_test(machine_for(factory, config), settings=run_settings(100, 40))  # resume is rare
    assert len(checked) > 500 and set(checked) == set(BY_NAME)


def test_a_snapshot_answers_every_state_query_once_and_draws_ids_from_the_state() -> None:
    """The snapshot names no query: each one the state answers (with or without arguments) passes through and is
    asked of the state once while the snapshot lives; a new id is drawn from the state every time."""
    from kvfuzz.engine.arguments import Snapshot
    from kvfuzz.engine.expected import ProgramState, Status

    execution = Target(paged_allocator, MachineConfig()).start()
    execution.execute("admit", {"seq": "s0", "namespace": (), "system": (), "suffix": [1, 2]})
    state = execution.engine.expected
    asked: list[str] = []
    queries = [name for name in vars(ProgramState) if not name.startswith("_") and callable(getattr(state, name))]
    assert {"ids", "computed_ids", "length", "new_id"} <= set(queries)
    for name in queries:
        original = getattr(state, name)
        setattr(state, name, lambda *args, name=name, original=original: asked.append(name) or original(*args))
    snapshot = Snapshot(state)
    answers = []
    for _ in range(2):
        assert snapshot.ids(Status.RUNNING) == ["s0"] and snapshot.length("s0") == 2
        assert snapshot.computed_ids() == [] and snapshot.caps is state.caps
        answers.append(list(asked))
    assert {"ids", "length", "computed_ids"} <= set(answers[0]) and answers[1] == answers[0]  # asked again: kept
    assert snapshot.new_id() != snapshot.new_id() and asked.count("new_id") == 2
    execution.teardown()


def test_the_table_keeps_its_order_whichever_module_holds_a_row() -> None:
    """The table's order is random programs' order of choices: rows moving from the table into their features (or a
    new feature's rows) leave it as it was, and a new operation goes at the end."""
    assert [operation.name for operation in OPERATIONS] == [
        "admit", "step", "readmit", "grow", "preempt", "decode", "fork", "swap_out", "free", "swap_in", "rollback",
        "evict", "evict_blocks", "reset_cache", "land_loads", "resume", "misuse",
    ]  # fmt: skip


def test_the_table_is_assembled_only_when_its_order_names_each_row_once() -> None:
    step, free = BY_NAME["step"], BY_NAME["free"]
    assert assembled((step, free), ("free", "step")) == (free, step)
    for order in [("step",), ("free", "step", "misuse"), ("free", "step", "step")]:
        with pytest.raises(ValueError, match="ORDER and its rows disagree"):
            assembled((step, free), order)
    with pytest.raises(ValueError, match="ORDER and its rows disagree"):
        assembled((step, free, step), ("free", "step"))


def test_a_feature_s_rows_live_in_its_feature_module() -> None:
    """Each optional capability's operations are declared by its feature, and the table holds every one of them."""
    from kvfuzz.engine.features import eviction, forks, host_tier, preemption, rollback, swap

    owners = {"fork": forks, "preempt": preemption, "swap_out": swap, "swap_in": swap, "rollback": rollback}
    owners |= {"evict": eviction, "evict_blocks": eviction, "reset_cache": eviction}
    owners |= {"land_loads": host_tier, "resume": host_tier}
    for name, module in owners.items():
        assert BY_NAME[name] in module.ROWS, name
    assert all(operation.needs == () for operation in CORE)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_filled_pick_has_something_to_draw_from_in_every_state(name: str) -> None:
    """Enablement never asks a ``FilledPick`` (the misuse calls) for its options: they must never be empty, or an
    operation would be enabled with nothing to draw."""
    from kvfuzz.engine.arguments import FilledPick

    factory, config = CONFIGS[name]
    filled = [(operation, argument) for operation in OPERATIONS for _, argument in operation.arguments]
    filled = [(operation, argument) for operation, argument in filled if isinstance(argument, FilledPick)]
    assert filled, "no operation draws from a FilledPick"
    for execution in _states(Target(factory, config), random.Random(3), programs=20, length=40):
        state = execution.engine.expected
        for operation, argument in filled:
            if operation.enabled(state):
                assert argument.options(state), operation.name


def _hits_scheduled_writes(spec: Any) -> Any:
    """kvfuzz's allocator that registers blocks at allocation, declared as vLLM declares it: a cache hit may cover
    a block the next step writes, so sequences await a step (not computed while their tokens are all written)."""
    import attrs

    from kvfuzz.zoo.variants import MatchableAtAllocation

    allocator = MatchableAtAllocation(spec.block_size, spec.num_blocks, inflight_window=0)
    allocator.capabilities = attrs.evolve(
        allocator.capabilities,
        hits_scheduled_writes=True,
        shares_scheduled_blocks=True,
        free_lands_scheduled_writes=True,
        preempt_scheduled=False,
        fork=False,
        rollback=False,
    )
    return allocator


CENSUS_CONFIGS = {**CONFIGS, "hits on scheduled writes": (_hits_scheduled_writes, MachineConfig(num_blocks=8))}


@pytest.mark.parametrize("name", sorted(CENSUS_CONFIGS))
def test_the_census_snapshot_answers_the_sequence_lists_as_the_state_does(name: str) -> None:
    """Enablement reads ``ids``, ``live_ids`` and ``computed_ids`` from one census of the sequences: in every state
    random programs reach (the asynchronous host tier's loading and loaded sequences, swapped and preempted ones,
    sequences awaiting a step among them), each list is the state's own, in the same order, and the enabled
    operations the same; the census is made once per state however many lists are asked."""
    from kvfuzz.engine.arguments import CensusSnapshot, snapshot_of
    from kvfuzz.engine.expected import ExpectedState, Status

    factory, config = CENSUS_CONFIGS[name]
    censuses = 0
    original = ExpectedState.census

    def counted(state: ExpectedState) -> Any:
        nonlocal censuses
        censuses += 1
        return original(state)

    statuses_seen: set[Status] = set()
    states = awaiting = 0
    try:
        ExpectedState.census = counted  # type: ignore[method-assign]
        for execution in _states(Target(factory, config), random.Random(5), programs=30, length=40):
            state = execution.engine.expected
            snapshot = snapshot_of(state)
            assert isinstance(snapshot, CensusSnapshot)
            before = censuses
            for _ in range(2):
                for status in Status:
                    assert snapshot.ids(status) == state.ids(status)
                    assert snapshot.ids(status, groups=True) == state.ids(status, groups=True)
                    statuses_seen.update([status] if state.ids(status) else [])
                assert snapshot.live_ids() == state.live_ids()
                assert snapshot.computed_ids() == state.computed_ids()
                assert snapshot.freeable_ids() == state.freeable_ids()
            assert censuses == before + 1
            assert [op.name for op in OPERATIONS if op.enabled(snapshot)] == [
                op.name for op in OPERATIONS if op.enabled(state)
            ]
            states += 1
            awaiting += any(model.awaits_step for model in state.seqs.values())
    finally:
        ExpectedState.census = original  # type: ignore[method-assign]
    assert states == 1200 and Status.RUNNING in statuses_seen and Status.PREEMPTED in statuses_seen
    assert awaiting or name != "hits on scheduled writes", "no sequence ever awaited a step"
