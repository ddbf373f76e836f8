"""The files a command writes: never one of the files it reads, and each written whole or not at all.

A trace may be the only record of a failure, so an output that names an input (the same path, a symbolic link to
it, a hard link) is refused before any work, as is one file named for two outputs. An output is written to a
temporary file beside it and renamed over its name: the name holds the old file or the whole new one, never part of
it, and a write that fails leaves nothing behind. An output that names an existing file that is not a regular one
(a FIFO, a character device such as ``/dev/full``, a socket), or an open descriptor (``/dev/stdout``, ``/dev/fd/N``,
``/proc/self/fd/N``: whatever a shell's redirection made it), is never renamed over, which would replace it with a
regular file: the content is written into it, as a shell's ``>`` would, and a write it refuses (``/dev/full``: no
space left; a socket: no open) is one line naming it.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Mapping, Optional


class OutputNotWritten(Exception):
    """An output could not be written: the message names the path and says why, in one line."""


def same_file(first: Path, second: Path) -> bool:
    """Whether two names are one file: the same path, or links (symbolic or hard) to one file."""
    try:
        return os.path.samefile(first, second)
    except OSError:  # one of them does not exist yet: one file only if both names resolve to one path
        return os.path.realpath(first) == os.path.realpath(second)


def check_outputs(outputs: Mapping[str, Optional[str]], inputs: Mapping[str, Optional[str]]) -> None:
    """``outputs`` (flag -> path, None when not asked for) can be written without touching ``inputs`` (argument
    -> path, None when not a file): each goes into a directory that exists, is no directory itself, is none of the
    inputs and not the file of another output. Raises ``ValueError``, one line naming the flag and the path."""
    checked: dict[str, Path] = {}
    for flag, value in outputs.items():
        if not value:
            continue
        path = Path(value)
        if path.is_dir():
            raise ValueError(f"{flag} {value}: is a directory; name the file to write")
        if not path.resolve().parent.is_dir():
            raise ValueError(f"{flag} {value}: directory {path.parent} does not exist")
        for name, source in inputs.items():
            if source is not None and Path(source).exists() and same_file(path, Path(source)):
                raise ValueError(
                    f"{flag} {value}: is the input {name} {source}, which writing it would destroy; name another file"
                )
        for other_flag, other in checked.items():
            if same_file(path, other):
                raise ValueError(f"{flag} {value}: is the same file as {other_flag} {other}; name another file")
        checked[flag] = path


@contextlib.contextmanager
def written_atomically(path: Path) -> Iterator[Path]:
    """A temporary path for the caller to write ``path``'s content to (hidden, in the same directory, with the same
    suffix, so that a writer choosing its format by the suffix still does); once the block ends it is renamed over
    ``path`` (over a symbolic link's target, the link kept), or, where ``path`` is written in place
    (:func:`_written_in_place`: a FIFO, a device, an open descriptor), copied into it. A block that raises leaves
    ``path`` as it was and no temporary file; an ``OSError`` becomes :class:`OutputNotWritten` naming ``path``."""
    target = Path(os.path.realpath(path))
    in_place = _written_in_place(path)
    temporary = (
        Path(tempfile.gettempdir()) if in_place else target.parent
    ) / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp{target.suffix}"
    try:
        yield temporary
        if in_place:
            with open(temporary, "rb") as source, open(path, "wb") as sink:  # the path: a magic link is followed
                shutil.copyfileobj(source, sink)
        else:
            os.replace(temporary, target)
    except OSError as error:
        raise OutputNotWritten(f"cannot write {path}: {error.strerror or error}") from error
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temporary)  # still there only when the block or the rename failed


_DESCRIPTOR = re.compile(r"/proc/(self|thread-self|[0-9]+)/fd/[0-9]+|/dev/fd/[0-9]+")
"""A name of an open file descriptor: a link the kernel resolves to whatever the descriptor is (even a pipe, which
no path names), never to be renamed over."""


def _written_in_place(path: Path) -> bool:
    """Whether ``path`` is written into rather than renamed over: it exists and is neither a regular file nor a
    directory (a FIFO, a device, a socket, named directly or through links), or it names an open descriptor
    (``/dev/stdout`` is a link to ``/proc/self/fd/1``), whatever that is."""
    try:
        mode = os.stat(path).st_mode  # follows the kernel's links to descriptors, which realpath cannot
    except OSError:
        return False
    if not stat.S_ISREG(mode):
        return not stat.S_ISDIR(mode)
    name = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links in a row
        if _DESCRIPTOR.fullmatch(name):
            return True
        try:
            name = os.path.normpath(os.path.join(os.path.dirname(name), os.readlink(name)))
        except OSError:  # not a link: the chain ends at a regular file
            return False
    return False


def write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) as the whole content of ``path``, atomically (:func:`written_atomically`); a character
    UTF-8 cannot hold (a surrogate escape of a file name that is not UTF-8) is written as its escape."""
    with written_atomically(path) as temporary:
        temporary.write_text(text, encoding="utf-8", errors="backslashreplace")


def write_or_print(text: str, output: Optional[str], run_it: str) -> int:
    """An exported file's text written to ``output`` (then a line saying so and how to run it: ``run_it``, given
    the path), or printed when no output is named; the exit status (2, in one line, when it cannot be written)."""
    if not output:
        print(text, end="")
        return 0
    try:
        write_text(Path(output), text)
    except OutputNotWritten as error:
        print(f"kvfuzz: {error}", file=sys.stderr)
        return 2
    print(f"wrote {output}; run it with: {run_it.format(path=output)}")
    return 0
