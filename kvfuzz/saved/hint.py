"""The commands kvfuzz prints for a saved failure (``kvfuzz run``, ``replay`` and ``campaign`` print them): how to
replay it and how to see it as a timeline, kept free of heavy imports so that any command can print them. Each works
as printed: a trace that names an allocator replay would not load on its own (a ``MODULE:FACTORY`` the user named,
not registered: :class:`kvfuzz.registry.AllocatorTrust`) gets ``--trust-allocator``, since the user who ran it named
that allocator themselves."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional


def default_page(trace: Path) -> Path:
    """Where ``kvfuzz show`` writes a trace's page unless told otherwise: ``NAME.html`` beside the trace."""
    return trace.with_name(trace.stem + ".html")


def trusting(allocator: Optional[str]) -> str:
    """`` --trust-allocator`` where replaying a trace of ``allocator`` needs it (None: a scheduler trace, which
    names no allocator)."""
    if allocator is None:
        return ""
    from kvfuzz.registry import AllocatorTrust, UntrustedAllocator

    try:
        AllocatorTrust().check(allocator)
    except UntrustedAllocator:
        return " --trust-allocator"
    return ""


def replay_hint(trace: Path, allocator: Optional[str] = None) -> str:
    """One line: the command that replays the trace saved in ``trace`` (recorded against ``allocator``)."""
    return f"replay it with: {replay_command(trace, allocator)}"


def replay_command(trace: Path, allocator: Optional[str] = None) -> str:
    """The command that replays the trace saved in ``trace`` (recorded against ``allocator``)."""
    return f"kvfuzz replay{trusting(allocator)} {shlex.quote(str(trace))}"


def show_hint(trace: Path, allocator: Optional[str] = None) -> str:
    """One line: the command that draws the timeline of the trace saved in ``trace`` (recorded against
    ``allocator``), and the page it writes."""
    page = shlex.quote(str(default_page(trace)))
    return f"see it as a timeline: kvfuzz show{trusting(allocator)} {shlex.quote(str(trace))} (writes {page})"
