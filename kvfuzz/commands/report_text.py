"""What every target's ``kvfuzz report`` shares (:mod:`kvfuzz.commands.trace_kinds`): how a trace's text is written
into Markdown."""

from __future__ import annotations


def fenced(text: str, language: str = "text") -> str:
    """``text`` in a fenced code block whose fence no line of it can close."""
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}{language}\n{text.rstrip()}\n{fence}"


def paragraph(text: str) -> str:
    """Trace text as Markdown prose: printable, and no character that would start markup."""
    return "".join(char if char.isprintable() or char == "\n" else " " for char in text).replace("<", "&lt;")
