"""``--pin ROW=VALUE``: a scheduler campaign run on one swarmed feature holds rows of the swarm table
(:data:`kvfuzz.scheduler.swarm.DIMENSIONS`) at one value each, and draws the others as it would.

A pin is checked against its row's domain, the values the row can draw, so a pinned campaign runs only
configurations an unpinned one could draw, or against a value the row keeps for pins alone (``pin_only``: a feature
campaigns run only when asked). A value is written as :func:`value_text` writes it (``true``/``false``
for a yes-or-no row, the number or the name otherwise), the same text the rerun command repeats.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from kvfuzz.scheduler.swarm import DIMENSIONS

Pins = tuple[tuple[str, Any], ...]
"""(row, value) pairs, one per pinned row, in the order given."""


class PinRefused(ValueError):
    """A ``--pin`` that names no row, a value outside its row's domain, or a row pinned twice; its message is the
    one line the CLI prints."""


def value_text(value: Any) -> str:
    """How a row's value is written on the command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse_pins(texts: Sequence[str]) -> Pins:
    """The pins ``ROW=VALUE`` texts name; raises :class:`PinRefused` for the first one that is not a row of the swarm
    table with a value of its domain."""
    rows = {dimension.name: dimension.pinnable for dimension in DIMENSIONS}
    pins: dict[str, Any] = {}
    for text in texts:
        row, equals, written = text.partition("=")
        row = row.strip()
        if not equals or row not in rows:
            raise PinRefused(
                f"--pin {text}: {'no swarm row ' + repr(row) if equals else 'expected ROW=VALUE'}; the rows: "
                f"{', '.join(rows)} (kvfuzz/scheduler/swarm.py)"
            )
        if row in pins:
            raise PinRefused(f"--pin {text}: {row} is pinned twice")
        domain = rows[row]
        matches = [value for value in domain if value_text(value).lower() == written.strip().lower()]
        if not matches:
            raise PinRefused(f"--pin {text}: {row} takes one of {', '.join(map(value_text, domain))}")
        pins[row] = matches[0]
    return tuple(pins.items())


def pin_arguments(pins: Pins) -> list[str]:
    """The command-line arguments that pin ``pins`` again."""
    return [argument for row, value in pins for argument in ("--pin", f"{row}={value_text(value)}")]


def describe_pins(pins: Iterable[tuple[str, Any]]) -> str:
    """The pins for a person: ``async_scheduling=true, speculative_tokens=2``."""
    return ", ".join(f"{row}={value_text(value)}" for row, value in pins)
