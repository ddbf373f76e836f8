"""One campaign at a time on a local corpus: a second one would claim and save the same findings again, and recover
the journals of the first one's dead workers as its own.

The lock is an exclusive ``flock`` on a file in the corpus's campaign state, holding the owner's pid for the
message a second campaign prints. The kernel releases it when the last process holding it ends, however it ends
(the campaign's workers inherit it, so a campaign killed while its workers still save what they hold keeps it until
they are gone): a lock left behind by a dead campaign is taken over as if it were not there. The file itself stays.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "lock"
"""Inside the campaign state directory: the lock, and the pid of the campaign holding it."""


class CorpusInUse(ValueError):
    """Another campaign (alive) holds the corpus."""


class CorpusLock:
    """The corpus's campaign lock, held from :meth:`acquire` until :meth:`release` or the end of every process that
    inherited it. Invariant: ``_descriptor`` is the open, locked file while held, None otherwise."""

    def __init__(self, state: Path, corpus: Path) -> None:
        self.path = state / LOCK_FILE
        self.corpus = corpus  # named in the message
        self._descriptor: int | None = None

    def acquire(self) -> None:
        """Take the lock and write this process's pid in it; :class:`CorpusInUse` (one line) when a live campaign
        holds it. Raises ``OSError`` when the state directory cannot be written."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(descriptor, 32).decode(errors="replace").strip() or "unknown"
            os.close(descriptor)
            raise CorpusInUse(
                f"--corpus {self.corpus}: another campaign (pid {owner}) is running on it; wait for it to end, or "
                "give this one another --corpus"
            ) from None
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"{os.getpid()}\n".encode())
        self._descriptor = descriptor

    def release(self) -> None:
        descriptor, self._descriptor = self._descriptor, None
        if descriptor is not None:
            os.close(descriptor)
