"""The last words of a run the allocator kills: one line after the process is gone, naming the journal that holds
the program it was running and the command that turns it into a trace.

A dying process cannot say this itself (nothing runs after SIGKILL, and a segfault leaves only what
``faulthandler`` prints), so a watcher says it: a small interpreter running a few lines of its own (no kvfuzz, no
torch), reading a pipe from the run until it closes, which happens when the run ends, however it ends. If the run's
journal is still there then, the run died (a run that ends, on its own or on a signal it handles, removes its
journal) and the watcher prints the line on the standard error it shares with the run, after whatever the run
printed as it died.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Iterator

_WATCHER = """
import os, signal, sys
for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, signal.SIG_IGN)
sys.stdin.buffer.read()
if os.path.exists(sys.argv[1]):
    sys.stderr.write(sys.argv[2] + "\\n")
"""
"""The watcher: it ignores the signals that stop the run (they reach the whole process group), since it must
outlive the run to speak."""


@contextlib.contextmanager
def last_words(journal: Path, message: str) -> Iterator[None]:
    """While active, ``message`` is printed on standard error if this process dies and leaves ``journal`` behind.
    A watcher that cannot be started costs only the message."""
    try:
        watcher = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WATCHER, str(journal), message],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
        )
    except OSError:
        yield
        return
    try:
        yield
    finally:
        assert watcher.stdin is not None
        watcher.stdin.close()
        watcher.wait()
