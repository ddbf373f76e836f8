"""The trace commands (``kvfuzz replay``, ``show``, ``export``, ``report``) over every target's traces: each command
is written once and hands a file to its kind's module, told by the file's bytes
(:func:`kvfuzz.trace_files.json_file_kind`); a target contributes one module with the functions of :class:`TraceKind`
(the allocator target's
:mod:`kvfuzz.commands.allocator_traces`, the scheduler targets' :mod:`kvfuzz.commands.scheduler_traces`). A file of
neither kind goes to the allocator target's, whose loader says in one line what is wrong with it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Protocol

from kvfuzz.registry import AllocatorTrust
from kvfuzz.trace_files import json_file_kind


class TraceKind(Protocol):
    """What a target's trace module gives the trace commands."""

    def replay_file(
        self, path: str, allocator: Optional[str], call_timeout: Optional[float], trust: AllocatorTrust
    ) -> str:
        """Replay the trace at ``path`` and print what happened; its outcome, a key of
        :data:`kvfuzz.commands.replay.OUTCOMES`."""
        ...

    def show(self, args: argparse.Namespace) -> int:
        """``kvfuzz show`` of the trace ``args.trace``: its exit status."""
        ...

    def export(self, args: argparse.Namespace) -> int:
        """``kvfuzz export`` of the trace ``args.trace``: its exit status."""
        ...

    def report(self, path: str) -> tuple[str, Optional[str]]:
        """``kvfuzz report``'s Markdown of the trace at ``path``, and its standalone reproducer's source (None where
        none is generated); raises its format's :class:`~kvfuzz.trace_files.TraceFileError` for a file that is not
        a valid trace of the kind."""
        ...


def kind_of(path: str) -> TraceKind:
    """The trace module of the file at ``path``."""
    if json_file_kind(Path(path)) == "scheduler-trace":
        from kvfuzz.commands import scheduler_traces

        return scheduler_traces
    from kvfuzz.commands import allocator_traces

    return allocator_traces
