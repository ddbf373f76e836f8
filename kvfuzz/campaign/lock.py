"""One campaign at a time on a local corpus: a second one would claim and save the same findings again, and recover
the journals of the first one's dead workers as its own.

The lock is an exclusive ``flock`` on a file in the corpus's campaign state, holding the owner's pid for the
message a second campaign prints. The kernel releases it when the last process holding it ends, however it ends
(the campaign's workers inherit it, so a campaign killed while its workers still save what they hold keeps it until
they are gone): a lock left behind by a dead campaign is taken over as if it were not there. The file itself stays.

A corpus may come from elsewhere (git carries symbolic links), so neither the campaign state directory nor the lock
file in it is followed if it is a link, the lock file is opened without truncating, and it is used only if it is a
regular file with one name: a link planted there (to a file the campaign would otherwise overwrite with its pid, or
to a directory holding one) is refused in one line, its target untouched.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from kvfuzz.text import printable

LOCK_FILE = "lock"
"""Inside the campaign state directory: the lock, and the pid of the campaign holding it."""


class CorpusInUse(ValueError):
    """Another campaign (alive) holds the corpus, or its lock file is not one kvfuzz may write."""


PID_WIDTH = 20
"""The pid is written right-aligned in this many characters and a newline, over whatever the file held (a longer
number is never left behind: pids are shorter), so the file is never truncated."""


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
        state = self.path.parent
        state.mkdir(parents=True, exist_ok=True)
        try:
            directory = os.open(state, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as error:
            if error.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            link = printable(os.readlink(state))
            raise self._not_a_lock(f"a symbolic link (to {link})", f"state directory {state}") from None
        try:
            descriptor = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666, dir_fd=directory)
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            link = os.readlink(LOCK_FILE, dir_fd=directory)
            raise self._not_a_lock(f"a symbolic link (to {printable(link)})") from None
        finally:
            os.close(directory)
        found = os.fstat(descriptor)
        if not stat.S_ISREG(found.st_mode) or found.st_nlink != 1:
            os.close(descriptor)
            raise self._not_a_lock("not a regular file" if not stat.S_ISREG(found.st_mode) else "a hard link")
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(descriptor, 32).decode(errors="replace").strip() or "unknown"
            os.close(descriptor)
            raise CorpusInUse(
                f"--corpus {self.corpus}: another campaign (pid {owner}) is running on it; wait for it to end, or "
                "give this one another --corpus"
            ) from None
        os.pwrite(descriptor, f"{os.getpid():>{PID_WIDTH}}\n".encode(), 0)
        self._descriptor = descriptor

    def _not_a_lock(self, what: str, name: str = "") -> CorpusInUse:
        return CorpusInUse(
            f"--corpus {self.corpus}: its campaign {name or f'lock {self.path}'} is {what}, which kvfuzz will not "
            "write through; remove it (a campaign makes its own)"
        )

    def release(self) -> None:
        descriptor, self._descriptor = self._descriptor, None
        if descriptor is not None:
            os.close(descriptor)
