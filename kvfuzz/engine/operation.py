"""One row of the operation table (:mod:`kvfuzz.program.operations`): an operation a program may call, what it needs,
how its arguments are drawn (:mod:`kvfuzz.engine.arguments`) and what the engine does with them.

It lives beside the engine so that each feature (:mod:`kvfuzz.engine.features`) declares its own rows next to the
engine functions they call. An operation is enabled when the allocator declares every capability in ``needs``,
``condition`` holds, and every argument has something to draw from (a ``Pick`` over running sequences needs a running
sequence). A recorded call is valid when its operation is enabled and every argument is one the operation could have
drawn in that state.
"""

from __future__ import annotations

import functools
import random
from typing import Any, Callable, Mapping, Sequence

import attrs

from kvfuzz.allocator.types import Capabilities
from kvfuzz.engine.arguments import Argument, BlockIds, Pick, Snapshot
from kvfuzz.engine.expected import ProgramState


def _always(state: ProgramState) -> bool:
    return True


@attrs.frozen(cache_hash=True)  # hashed once: enablement_of is asked for every program
class Operation:
    """One operation: what it needs, how its arguments are drawn, and what the engine does with them."""

    name: str  # the rule name programs, traces and exported tests use
    apply: Callable[..., object]  # apply(engine, **arguments): the engine performs it and checks (any result ignored)
    arguments: tuple[tuple[str, Argument], ...] = ()  # in draw order
    needs: tuple[str, ...] = ()  # Capabilities fields that must all be declared
    condition: Callable[[ProgramState], object] = _always  # what else the state must hold: true when its answer is
    doc: str = ""  # what it models, for a person
    # The arguments whose availability depends on the state (those of the other kinds always have a value to draw).
    gated: tuple[Argument, ...] = attrs.field(init=False, eq=False, repr=False)
    # Their options, in the same order: a snapshot answers each once per state, whichever operation asks.
    gate_options: tuple[Callable[[ProgramState], Sequence[Any]], ...] = attrs.field(init=False, eq=False, repr=False)

    @gated.default
    def _gated_arguments(self) -> tuple[Argument, ...]:
        return tuple(argument for _, argument in self.arguments if argument.gating)

    @gate_options.default
    def _gate_options(self) -> tuple[Callable[[ProgramState], Sequence[Any]], ...]:
        listed = tuple(argument.options for argument in self.gated if isinstance(argument, (Pick, BlockIds)))
        if len(listed) != len(self.gated):
            raise TypeError(f"operation {self.name}: an argument that can have nothing to draw from lists no options")
        return listed

    def enabled(self, state: ProgramState) -> bool:
        """Whether a program may call this operation now (plain loops: it is asked for every operation before
        every call)."""
        return self.declared(state.caps) and self.allowed(state)

    def declared(self, caps: Capabilities) -> bool:
        """Whether the allocator declares every capability the operation needs (fixed for an example)."""
        for capability in self.needs:
            if not getattr(caps, capability):
                return False
        return True

    def allowed(self, state: ProgramState) -> bool:
        """Whether the state lets a program call this operation now, the allocator declaring what it needs:
        ``condition`` holds and every argument has something to draw from."""
        if self.condition is not _always and not self.condition(state):
            return False
        if isinstance(state, Snapshot):  # the options themselves, each answered once per state (what available asks)
            for options in self.gate_options:
                if not state.options(options):
                    return False
            return True
        for argument in self.gated:
            if not argument.available(state):
                return False
        return True

    def accepts(self, state: ProgramState, arguments: Mapping[str, Any]) -> bool:
        """Whether a recorded call with these arguments could have been drawn now."""
        return (
            self.enabled(state)
            and set(arguments) == {name for name, _ in self.arguments}
            and all(argument.accepts(state, arguments[name]) for name, argument in self.arguments)
        )

    def draw(self, state: ProgramState, rng: random.Random) -> dict[str, Any]:
        """Arguments drawn by a plain random generator, with the machine's distribution."""
        return {name: argument.draw(state, rng) for name, argument in self.arguments}


class Enablement:
    """Which of some operations (each with a weight) a snapshot's state allows, asking each distinct gate once: the
    gates are the operations' conditions and their gating arguments' options (:attr:`Operation.gate_options`), one
    function each, answered through the snapshot (so that the draw that follows reuses the options), their truth
    what counts; a function serving several operations (one's condition, another's options) is asked once. The
    answer is the same as asking each operation's :meth:`Operation.allowed` (``tests/test_enablement.py`` compares
    them after every call), in the operations' order; the list made for one combination of the gates' answers is
    kept for the next state that answers them alike."""

    def __init__(self, operations: Sequence[tuple[Operation, float]]) -> None:
        self.operations = tuple(operations)  # in the table's order, with their weights
        gates: dict[Callable[[ProgramState], object], int] = {}  # each distinct gate -> its place among the answers
        needs = []  # per operation: the places of its condition's and its options' answers
        for operation, _ in self.operations:
            mine = [operation.condition] if operation.condition is not _always else []
            needs.append(tuple(gates.setdefault(gate, len(gates)) for gate in [*mine, *operation.gate_options]))
        self._gates = tuple(gates)  # asked in this order
        self._needs = tuple(needs)
        self._lists: dict[tuple[bool, ...], list[tuple[Operation, float]]] = {}  # the gates' answers -> the list

    def enabled(self, state: Snapshot) -> list[tuple[Operation, float]]:
        """The operations ``state`` allows, with their weights, in order (a list kept per answers: never change it)."""
        answers = state.gates(self._gates)
        listed = self._lists.get(answers)
        if listed is None:
            listed = self._lists[answers] = [
                pair for pair, mine in zip(self.operations, self._needs) if all(answers[place] for place in mine)
            ]
        return listed


@functools.lru_cache(maxsize=256)
def enablement_of(operations: tuple[tuple[Operation, float], ...]) -> Enablement:
    """The :class:`Enablement` of ``operations`` (with their weights), one per distinct tuple: the lists it keeps per
    answers serve every program drawn over the same operations, not just one."""
    return Enablement(operations)
