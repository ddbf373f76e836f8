"""What a campaign's worker processes tell the campaign, through one queue: progress, and each failure met.

Every message names the worker's slot (``worker``), so the campaign knows which worker is alive and what it does.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import attrs


@attrs.frozen
class Progress:
    """Examples and steps run since the worker's previous message (a heartbeat when both are 0), and its phase."""

    worker: int  # the worker's slot
    examples: int  # programs started since the last message
    steps: int  # calls executed since the last message
    phase: str  # "searching" or "shrinking"


@attrs.frozen
class Claimed:
    """The worker met a signature nobody had: it shrinks and saves it now."""

    worker: int
    signature: dict[str, Optional[str]]  # Signature.to_json()
    key: str  # Signature.key()
    program_length: int  # calls of the program as found
    trace: Optional[str] = None  # where the program as found is saved already (a scheduler failure's), if it is


@attrs.frozen
class Saved:
    """The worker shrank and saved a signature it claimed."""

    worker: int
    key: str  # the claimed signature's key
    shrunk_length: int  # calls of the shrunk program
    trace: Optional[str]  # where the trace was saved; None when it could not be
    note: Optional[str]  # why shrinking stopped early, or why the program was not shrunk
    reproduced: int  # confirmation replays that failed the same way
    replays: int  # confirmation replays run
    program: str  # the shrunk program, printed
    explanation: str  # kvfuzz's explanation of the failure
    unsaved_trace: Optional[dict[str, Any]] = None  # the whole trace when it could not be written


@attrs.frozen
class Seen:
    """The worker met a signature already known: counted, not shrunk again."""

    worker: int
    signature: dict[str, Optional[str]]
    key: str
    known: str  # where it is known from: a corpus trace, or the signature store's record


@attrs.frozen
class Done:
    """The worker stopped because the campaign asked it to."""

    worker: int


@attrs.frozen
class Crashed:
    """kvfuzz itself failed in the worker (not the allocator): the traceback, for a bug report."""

    worker: int
    traceback: str


@attrs.frozen
class HarnessFailed:
    """kvfuzz's own code failed driving the engine (a harness error, never a finding): the campaign ends on it."""

    worker: int
    description: str  # HarnessError.describe()


@attrs.frozen
class Said:
    """A line for the person running the campaign (where a finding was stored in Redis, say)."""

    worker: int
    line: str


@attrs.frozen
class Batch:
    """A worker ran one batch: its configuration, what it ran and what it reached (the result's ``batch_log``), and
    the configurations the engine refused before it (redrawn; a scheduler's)."""

    worker: int
    entry: dict[str, Any]
    refused: int


@attrs.frozen
class Covered:
    """A worker reached points of the code under test no earlier batch of its had (:mod:`kvfuzz.coverage`), and
    which files of the code under test it has imported (those the campaign reports)."""

    worker: int
    points: dict[str, Any]  # kvfuzz.coverage.measure.Reached.to_json()
    files: tuple[str, ...]


Message = Union[Progress, Claimed, Saved, Seen, Done, Crashed, HarnessFailed, Said, Batch, Covered]
