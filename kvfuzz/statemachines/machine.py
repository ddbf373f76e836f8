"""The Hypothesis state machine: one rule per entry of the operation table (:mod:`kvfuzz.program.operations`).

Each rule draws its arguments as the table says and hands them to the engine through an
:class:`~kvfuzz.program.execution.Execution`, which calls the allocator, plays the serving engine and checks every
invariant on what changed. A rule is enabled exactly when its operation is (one predicate, the table's), so a printed
failing program is a plain list of calls a person can paste into a test.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, cast

from hypothesis.stateful import RuleBasedStateMachine, precondition, rule
from hypothesis.strategies import SearchStrategy

from kvfuzz.engine.arguments import Snapshot, snapshot_of
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.operation import Operation
from kvfuzz.program.execution import Execution, Safeguards, Target
from kvfuzz.program.operations import OPERATIONS
from kvfuzz.program.stats import RunStats
from kvfuzz.registry import AllocatorFactory


class KVCacheMachine(RuleBasedStateMachine):
    """Drives ``factory(config.pool_spec())`` through admit, grow, fork, free, preempt, swap, rollback and evict."""

    factory: AllocatorFactory
    config: MachineConfig = MachineConfig()
    stats: Optional[RunStats] = None
    safeguards: Safeguards = Safeguards()

    def __init__(self) -> None:
        super().__init__()
        self.execution: Execution = Target(self.factory, self.config, self.stats, self.safeguards).start()
        self._snapshot: tuple[int, Snapshot] = (-1, snapshot_of(self.execution.engine.expected))

    @property
    def expected(self) -> Snapshot:
        """The state the operation table's enablement and argument draws read: its queries answered once per call
        (Hypothesis asks every rule's precondition before each draw)."""
        calls = len(self.execution.calls)
        if self._snapshot[0] != calls:
            self._snapshot = (calls, self._snapshot[1].renewed())
        return self._snapshot[1]

    def teardown(self) -> None:
        """Invariant 10 once every sequence is gone; skipped after a failure, whose state is already broken."""
        self.execution.teardown()


def _rule_for(operation: Operation) -> Callable[..., None]:
    def perform(self: KVCacheMachine, **arguments: Any) -> None:
        self.execution.execute(operation.name, arguments)

    perform.__name__ = perform.__qualname__ = operation.name
    perform.__doc__ = operation.doc
    strategies: dict[str, SearchStrategy[Any]] = {name: argument.strategy() for name, argument in operation.arguments}
    # rule()'s overloads single out its target/targets keywords, which a dict of strategies cannot rule out.
    as_rule = cast(Callable[..., Callable[[Callable[..., None]], Callable[..., None]]], rule)
    enabled = precondition(lambda self: operation.enabled(self.expected))
    return enabled(as_rule(**strategies)(perform))


for _operation in OPERATIONS:
    setattr(KVCacheMachine, _operation.name, _rule_for(_operation))
del _operation


def machine_for(
    factory: AllocatorFactory,
    config: MachineConfig = MachineConfig(),
    stats: Optional[RunStats] = None,
    safeguards: Safeguards = Safeguards(),
) -> type[KVCacheMachine]:
    """A machine class bound to one allocator factory and configuration (and, optionally, a run's counters and
    safeguards)."""
    name = getattr(factory, "__name__", "Allocator")
    return type(
        f"KVCacheMachine_{name}",
        (KVCacheMachine,),
        {"factory": staticmethod(factory), "config": config, "stats": stats, "safeguards": safeguards},
    )
