"""A program: the rules a machine executed, with their concrete arguments, printable as Python a person can paste."""

from __future__ import annotations

from typing import Any, Iterable

import attrs


@attrs.frozen
class Call:
    """One executed rule: ``state.<rule>(**arguments)``. Arguments are kept sorted by name."""

    rule: str
    arguments: tuple[tuple[str, Any], ...] = attrs.field(converter=lambda items: tuple(sorted(dict(items).items())))

    def kwargs(self) -> dict[str, Any]:
        return dict(self.arguments)

    def __str__(self) -> str:
        return f"state.{self.rule}({', '.join(f'{name}={value!r}' for name, value in self.arguments)})"


def program_text(machine_name: str, calls: Iterable[Call]) -> str:
    """The program as Hypothesis prints one: construct the machine, run each call, tear down."""
    return "\n".join([f"state = {machine_name}()", *map(str, calls), "state.teardown()"])
