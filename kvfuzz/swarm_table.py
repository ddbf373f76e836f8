"""Swarm tables, every target's: a campaign draws each batch's configuration one value per row of its target's table,
and ``--pin ROW=VALUE`` holds rows at one value.

A table is a tuple of rows, drawn in order from one ``random.Random`` (:func:`draw_values`), so a seed draws the
same configurations. The targets keep only their rows: the allocator's (:mod:`kvfuzz.campaign.swarm`, built from
what each allocator builds), vLLM's scheduler's (:mod:`kvfuzz.scheduler.swarm`) and SGLang's
(:mod:`kvfuzz.scheduler.sglang.swarm`). What a row is, how its draws are shaped, how a pin is read and checked, and
how pins are written back on a rerun's command line are here, once.

A pin is checked against its row's values (:meth:`Dimension.parse`), so a pinned campaign runs only configurations
an unpinned one could draw, or a value the row keeps for pins alone (``pin_only``: a feature campaigns run only when
asked). A value is written as :func:`value_text` writes it (``true``/``false`` for a yes-or-no row, the number or
the name otherwise, names joined by commas for a subset), the same text the rerun command repeats.
"""

from __future__ import annotations

import itertools
import random
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import attrs

Draw = Callable[[random.Random, tuple[Any, ...]], Any]
"""How a row draws: (rng, the row's domain) -> its value."""

Pins = tuple[tuple[str, Any], ...]
"""(row, value) pairs, one per pinned row, in the order given."""

NO_PINS: Mapping[str, Any] = MappingProxyType({})
"""No row pinned (row -> value, as :func:`draw_values` takes pins)."""


@attrs.frozen
class Dimension:
    """One row of a swarm table: ``name`` takes one of ``domain``'s values, the one ``draw`` picks from it.
    Invariant: ``draw`` returns a value of ``domain``, and ``domain`` holds every value it can return (so ``--pin``
    accepts exactly the values a campaign can draw, and ``pin_only``'s, which it never draws)."""

    name: str
    domain: tuple[Any, ...]
    draw: Draw  # (rng, domain) -> one of domain's values
    # (row, value): the row means something only where that row drew that value (or one of them, for a tuple or a
    # frozenset); elsewhere it takes domain[0] (its draw is made all the same), so a draw is not refused for setting
    # an option nothing uses
    needs: Optional[tuple[str, Any]] = None
    # values --pin accepts that ``draw`` never returns: a feature campaigns run only when asked
    pin_only: tuple[Any, ...] = ()
    # a second (row, value) the row means something only with, as ``needs``
    also_needs: Optional[tuple[str, Any]] = None
    # its values run different code of the engine (the model's KV-cache managers): a guided campaign's fresh draws
    # take them in turn rather than by the row's weights (kvfuzz.campaign.scheduler.guided)
    stratified: bool = False

    @property
    def pinnable(self) -> tuple[Any, ...]:
        """The values ``--pin`` accepts for this row: what it draws, and its pin-only values."""
        return self.domain + self.pin_only

    def value(self, rng: random.Random, drawn: Mapping[str, Any]) -> Any:
        """This row's value, given the rows drawn (or pinned) before it."""
        value = self.draw(rng, self.domain)
        for needed in (self.needs, self.also_needs):
            if needed is not None and not _meets(drawn[needed[0]], needed[1]):
                return self.domain[0]
        return value

    def parse(self, written: str) -> Any:
        """The pinnable value ``written`` names (as :func:`value_text` writes it, any case); raises ``ValueError``
        with what the row takes."""
        for value in self.pinnable:
            if value_text(value).lower() == written.strip().lower():
                return value
        raise ValueError(f"{self.name} takes {self.values_text()}")

    def values_text(self) -> str:
        """The pinnable values for a person: ``1, 2, 4`` (a run of whole numbers as ``4..256``)."""
        values = self.pinnable
        if len(values) > 4 and all(type(value) is int for value in values):
            if list(values) == list(range(values[0], values[0] + len(values))):
                return f"{values[0]}..{values[-1]}"
        return f"one of {', '.join(map(value_text, values))}"


@attrs.frozen
class Subset(Dimension):
    """A row whose value is a subset of ``domain``'s names, in ``domain``'s order and always holding ``always``:
    ``draw`` returns such a tuple (the invariant a subset row keeps in place of :class:`Dimension`'s)."""

    always: tuple[str, ...] = ()  # names every value holds

    def value(self, rng: random.Random, drawn: Mapping[str, Any]) -> Any:
        return self.draw(rng, self.domain)

    def parse(self, written: str) -> Any:
        names = {name.strip().lower() for name in written.split(",") if name.strip()}
        unknown = sorted(names - {name.lower() for name in self.domain})
        if unknown:
            raise ValueError(f"{self.name} takes names of {', '.join(self.domain)} (not {', '.join(unknown)})")
        return tuple(name for name in self.domain if name.lower() in names or name in self.always)

    def values_text(self) -> str:
        return f"names of {', '.join(self.domain)}, comma-separated ({', '.join(self.always)} always kept)"


def _meets(drawn: Any, wanted: Any) -> bool:
    """Whether a row's drawn value is the one another row needs (or one of them, a tuple or a frozenset)."""
    return drawn in wanted if isinstance(wanted, (tuple, frozenset)) else bool(drawn == wanted)


def draw_values(rng: random.Random, rows: Sequence[Dimension], pins: Mapping[str, Any]) -> dict[str, Any]:
    """Row name -> value: each row of ``rows`` drawn in order, a pinned one taking its pin (its draw is made all the
    same, so the other rows draw what they would unpinned; a row that needs a pinned row sees the pin)."""
    values: dict[str, Any] = {}
    for row in rows:
        values[row.name] = row.value(rng, {**values, **pins})
    values.update(pins)
    return values


# How rows draw.


def uniform(rng: random.Random, values: tuple[Any, ...]) -> Any:
    """Any value, each as likely."""
    return rng.choice(values)


def fixed(rng: random.Random, values: tuple[Any, ...]) -> Any:
    """A row of one value: that value, drawing nothing (so adding such a row leaves every other draw as it was)."""
    return values[0]


def biased_small(rng: random.Random, values: tuple[Any, ...]) -> Any:
    """A value of ``values`` (ascending), the small ones more often: the first half of the list twice as likely."""
    return values[min(int(rng.random() ** 1.5 * len(values)), len(values) - 1)]


def chance(probability: float) -> Draw:
    """The second of two values with ``probability``, else the first."""
    return lambda rng, values: values[1] if rng.random() < probability else values[0]


def weighted(weights: tuple[int, ...]) -> Draw:
    """Each value as often as its weight says."""
    return lambda rng, values: rng.choice(tuple(v for v, weight in zip(values, weights) for _ in range(weight)))


def split(*chances: float) -> Draw:
    """The second value with the first of ``chances``, the third with the second, and so on; else the first value
    (one draw: the first value is drawn for the same ``rng.random()`` as before a value was added at the end)."""

    def draw(rng: random.Random, values: tuple[Any, ...]) -> Any:
        roll = rng.random()
        for value, bound in zip(values[1:], itertools.accumulate(chances)):
            if roll < bound:
                return value
        return values[0]

    return draw


def weighted_choice(weights: tuple[int, ...]) -> Draw:
    """Each value with its weight (``random.choices``)."""
    return lambda rng, values: rng.choices(values, weights)[0]


# Pins.


class PinRefused(ValueError):
    """A ``--pin`` that names no row, a value outside its row's domain, or a row pinned twice; its message is the
    one line the CLI prints."""


def value_text(value: Any) -> str:
    """How a row's value is written on the command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(map(value_text, value))
    return str(value)


def parse_pins(texts: Sequence[str], rows: Sequence[Dimension], whose: str = "") -> Pins:
    """The pins ``ROW=VALUE`` texts name; raises :class:`PinRefused` for the first one that is not a row of ``rows``
    with a value the row takes. ``whose`` (``" for zoo:leaky"``) ends the refusal of a value, when tables differ."""
    by_name = {row.name: row for row in rows}
    pins: dict[str, Any] = {}
    for text in texts:
        name, equals, written = text.partition("=")
        name = name.strip()
        if not equals or name not in by_name:
            raise PinRefused(
                f"--pin {text}: {'no swarm row ' + repr(name) if equals else 'expected ROW=VALUE'}{whose}; the rows: "
                f"{', '.join(by_name)}"
            )
        if name in pins:
            raise PinRefused(f"--pin {text}: {name} is pinned twice")
        try:
            pins[name] = by_name[name].parse(written)
        except ValueError as error:
            raise PinRefused(f"--pin {text}: {error}{whose}") from None
    return tuple(pins.items())


def pin_arguments(pins: Pins) -> list[str]:
    """The command-line arguments that pin ``pins`` again."""
    return [argument for row, value in pins for argument in ("--pin", f"{row}={value_text(value)}")]


def describe_pins(pins: Iterable[tuple[str, Any]]) -> str:
    """The pins for a person: ``async_scheduling=true, speculative_tokens=2``."""
    return ", ".join(f"{row}={value_text(value)}" for row, value in pins)
