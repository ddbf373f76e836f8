"""Small helpers for text kvfuzz prints for a person."""

from __future__ import annotations


def plural(number: int, noun: str, nouns: str = "") -> str:
    """``1 example``, ``2 examples``: a number and its noun, plural unless the number is one (``nouns`` when the
    plural is not the noun plus s)."""
    return f"{number} {noun if number == 1 else nouns or noun + 's'}"
