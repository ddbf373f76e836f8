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


Message = Union[Progress, Claimed, Saved, Seen, Done, Crashed]
