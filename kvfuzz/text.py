"""Small helpers for text kvfuzz prints for a person."""

from __future__ import annotations


def plural(number: int, noun: str, nouns: str = "") -> str:
    """``1 example``, ``2 examples``: a number and its noun, plural unless the number is one (``nouns`` when the
    plural is not the noun plus s)."""
    return f"{number} {noun if number == 1 else nouns or noun + 's'}"


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on (an escape sequence's ESC, other control characters,
    anything not printable) written as its Python escape (``\\x1b``): a name kvfuzz did not choose (a file's, a
    Redis key) prints as itself, harmless, on one line."""
    return "".join(char if char.isprintable() else char.encode("unicode_escape").decode("ascii") for char in text)


def printable_lines(text: str) -> str:
    """``text`` as :func:`printable` writes it, its line breaks kept: a paragraph from a trace (an explanation)."""
    return "\n".join(printable(line) for line in text.split("\n"))
