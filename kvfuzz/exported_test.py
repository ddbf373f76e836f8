"""A trace exported as a standalone pytest file (``kvfuzz export``), every target's: the file's frame is written here
once, a target's export gives only the imports and the body that replays its program through kvfuzz's public API.

The frame: a docstring naming the trace the file came from, what it recorded and any notes (a known bug, a flaky
replay count), then the imports, then one test named after the failure and its trace's digest. The test fails while
the failure reproduces and passes once it is fixed. Nothing a trace holds (it may come from anyone) can end the
docstring or run as code: every text from it goes through :func:`docstring_text`."""

from __future__ import annotations

import re


def docstring_text(text: str) -> str:
    """``text`` as it may stand inside a triple-quoted docstring: backslashes, triple quotes and unprintable
    characters escaped, so that nothing a trace holds can end the docstring or run as code."""
    escaped = text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    return "".join(
        char if char == "\n" or char.isprintable() else char.encode("unicode_escape").decode("ascii")
        for char in escaped
    )


def known_bug_note(known_bug: str | None) -> str:
    """The docstring's note of a trace's known bug (the test fails until the engine fixes it); empty without one."""
    return f"\nKnown bug: {docstring_text(known_bug)}\n" if known_bug else ""


def pytest_file(
    source: str, recorded: str, failure: str, notes: str, imports: str, name: str, digest: str, body: str
) -> str:
    """The file of one exported trace: ``source`` where it came from, ``recorded`` what failed ("against ALLOCATOR",
    "of SCHEDULER (its engine)"), ``failure`` the recorded failure's text (indented), ``notes`` lines after it (each
    text from the trace already escaped: :func:`known_bug_note`), ``imports`` the import lines, ``name`` the failure
    in words (the test's name is it as an identifier, then ``digest``), ``body`` the test's indented statements."""
    identifier = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return f'''"""Regression test exported by kvfuzz from {docstring_text(source)}.

Recorded failure {docstring_text(recorded)}:
{docstring_text(failure)}
{notes}"""

{imports}


def test_{identifier}_{digest}():
{body}
'''
