"""Where a failure's trace went, and what kvfuzz prints of it, every target's: the commands that replay it and show
it as a timeline, and, when the corpus could not be written, the whole trace, so that the failure is not lost.

The commands work as printed: paths are quoted for a POSIX shell, and a trace that names an allocator replay would
not load on its own (a ``MODULE:FACTORY`` the user named, not registered: :class:`kvfuzz.registry.AllocatorTrust`)
gets ``--trust-allocator``, since the user who ran it named that allocator themselves. Kept free of heavy imports, so
that any command can print them.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Callable, Generic, Optional, Protocol, TypeVar

import attrs


class TraceRecord(Protocol):
    """What saving needs of a trace, whatever its format."""

    def to_json(self) -> dict[str, Any]: ...

    def file_name(self) -> str: ...


Record = TypeVar("Record", bound=TraceRecord)


@attrs.frozen
class SavedTrace(Generic[Record]):
    """Where a failure's trace went: written to ``path``, already there, or, when the corpus could not be written,
    nowhere but memory, in which case :meth:`report` shows the whole trace so that the failure is not lost."""

    trace: Record
    path: Path  # where it is, or would have been, saved
    written: bool  # False when the same trace was already saved there, or when it could not be written
    error: Optional[str] = None  # why it could not be written; None once it is on disk
    allocator: Optional[str] = None  # the allocator a replay of it loads (its trust decides the hint); None: none

    def text(self) -> str:
        """The trace file's content."""
        return json.dumps(self.trace.to_json(), indent=2)

    def report(self) -> str:
        """For a person: where the trace is, how to replay it and how to see it; or one line saying it was not saved
        followed by the trace itself."""
        if self.error is None:
            where = "saved to" if self.written else "already in the corpus:"
            hints = f"{replay_hint(self.path, self.allocator)}\n{show_hint(self.path, self.allocator)}"
            return f"trace {where} {self.path}\n{hints}"
        name = self.path.name
        return (
            f"trace NOT saved: cannot write {self.path} ({self.error}); here it is: save it as {name} and replay it "
            f"with: {replay_command(Path(name), self.allocator)}\n{self.text()}"
        )

    def json_fields(self) -> dict[str, Any]:
        """A run's ``--json`` fields for it: ``trace`` (where it was saved, or null), ``trace_error`` (why it could
        not be, or null) and ``unsaved_trace`` (the trace itself when it could not be)."""
        unsaved = self.error is not None
        return {
            "trace": None if unsaved else str(self.path),
            "trace_error": f"cannot write {self.path} ({self.error})" if unsaved else None,
            "unsaved_trace": self.trace.to_json() if unsaved else None,
        }


NO_TRACE_FIELDS: dict[str, Any] = {"trace": None, "trace_error": None, "unsaved_trace": None}
"""A run's ``--json`` trace fields when nothing failed."""


def save_or_keep(
    trace: Record,
    directory: Path,
    save: Callable[[Record, Path], tuple[Path, bool]],
    allocator: Optional[str] = None,
) -> SavedTrace[Record]:
    """``trace`` saved in ``directory`` by its format's ``save``; a corpus that cannot be written (read-only, full,
    not a directory) raises nothing: the result carries the error and the trace."""
    try:
        path, written = save(trace, directory)
    except OSError as error:
        return SavedTrace(trace, directory / trace.file_name(), False, error.strerror or str(error), allocator)
    return SavedTrace(trace, path, written, None, allocator)


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
