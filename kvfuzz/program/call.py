"""A program: the rules a machine executed, with their concrete arguments, printable as Python a person can paste."""

from __future__ import annotations

from typing import Any, Iterable

import attrs

from kvfuzz.engine.misuse import MisuseCall


def _by_name(items: Any) -> tuple[tuple[str, Any], ...]:
    """Arguments (a mapping, or (name, value) pairs: the last of a name counts) as pairs sorted by name."""
    return tuple(sorted((items if type(items) is dict else dict(items)).items()))


@attrs.frozen
class Call:
    """One executed rule: ``state.<rule>(**arguments)``. Arguments are kept sorted by name."""

    rule: str
    arguments: tuple[tuple[str, Any], ...] = attrs.field(converter=_by_name)

    def kwargs(self) -> dict[str, Any]:
        return dict(self.arguments)

    def __str__(self) -> str:
        return f"state.{self.rule}({', '.join(f'{name}={value!r}' for name, value in self.arguments)})"


def program_text(machine_name: str, calls: Iterable[Call]) -> str:
    """The program as Hypothesis prints one: construct the machine, run each call, tear down."""
    return "\n".join([f"state = {machine_name}()", *map(str, calls), "state.teardown()"])


def program_json(program: tuple[Call, ...]) -> list[dict[str, Any]]:
    """A program as a trace lists it: ``[{"rule": ..., "arguments": {...}}, ...]`` (also each line of a journal)."""
    return [
        {"rule": call.rule, "arguments": {name: _encode(value) for name, value in call.arguments}} for call in program
    ]


def _encode(value: Any) -> Any:
    if isinstance(value, MisuseCall):
        return {"misuse": {"op": value.op, "args": _encode(value.args), "why": value.why}}
    if isinstance(value, (tuple, list)):
        return [_encode(item) for item in value]
    return value
