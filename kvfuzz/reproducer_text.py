"""What every generated standalone reproducer shares, whichever engine it plays (the allocator families of
:mod:`kvfuzz.reproducers`, vLLM's scheduler in :mod:`kvfuzz.scheduler.reproducer`): the refusal of a trace none is
generated for, and the comment lines it states a recorded failure or a known bug in."""

from __future__ import annotations


class NotReproducible(ValueError):
    """A trace no standalone reproducer is generated for; the message says why, in one line."""


def comment(text: str, width: int = 116) -> str:
    """``text`` as ``#`` comment lines of at most ``width`` columns (its characters made printable)."""
    clean = "".join(char if char.isprintable() else " " for char in text)
    lines, line = [], "#"
    for word in clean.split():
        if len(line) + 1 + len(word) > width and line != "#":
            lines.append(line)
            line = "#"
        line += " " + word
    lines.append(line)
    return "\n".join(lines)
