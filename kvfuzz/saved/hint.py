"""The line that points a person at a saved failure's timeline (``kvfuzz run``, ``replay`` and ``campaign`` print
it), kept free of heavy imports so that any command can print it."""

from __future__ import annotations

import shlex
from pathlib import Path


def default_page(trace: Path) -> Path:
    """Where ``kvfuzz show`` writes a trace's page unless told otherwise: ``NAME.html`` in the current directory."""
    return Path(trace.stem + ".html")


def show_hint(trace: Path) -> str:
    """One line: the command that draws the timeline of the trace saved in ``trace``, and the page it writes."""
    return (
        f"see it as a timeline: kvfuzz show {shlex.quote(str(trace))} (writes {shlex.quote(str(default_page(trace)))})"
    )
