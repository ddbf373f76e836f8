"""With ``--json``, standard output carries kvfuzz's JSON and nothing else.

An allocator may print: at import, when it is built, in any operation, from Python or from C, in the process or in
a campaign's worker processes. While :func:`stdout_for_json_only` is active, all of it goes to standard error
instead: ``sys.stdout`` is standard error, and so is file descriptor 1 itself (so ``os.write(1, ...)``, C's
``printf`` and every child process started meanwhile write there). The command hands its JSON to :func:`emit_json`,
which holds it until the real standard output is back, then writes it there.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import sys
from contextvars import ContextVar
from typing import Any, Iterator, Optional

_held: ContextVar[Optional[io.StringIO]] = ContextVar("kvfuzz_json_held", default=None)
"""While :func:`stdout_for_json_only` is active: the JSON emitted so far, for the real standard output."""


def emit_json(value: Any) -> None:
    """Print ``value`` as indented JSON on the real standard output: at once, or, while
    :func:`stdout_for_json_only` is active, when it ends."""
    text = json.dumps(value, indent=2) + "\n"
    held = _held.get()
    if held is None:
        sys.stdout.write(text)
    else:
        held.write(text)


def _flush_c_stdio() -> None:
    """Flush C's stdio buffers, so that what C code printed while descriptor 1 was redirected goes there, not to
    the real standard output once it is restored (best effort: where there is no C library to ask, nothing)."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def stdout_for_json_only() -> Iterator[None]:
    """While active, everything written to standard output (``sys.stdout`` and file descriptor 1) goes to standard
    error; afterwards both are restored and the JSON :func:`emit_json` held is written to standard output."""
    held = io.StringIO()
    token = _held.set(held)
    previous = sys.stdout
    previous.flush()
    _flush_c_stdio()
    try:
        saved: Optional[int] = os.dup(1)
    except OSError:  # no descriptor 1 to keep (a closed standard output): Python's writes are redirected all the same
        saved = None
    if saved is not None:
        os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stderr.flush()
        _flush_c_stdio()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
        sys.stdout = previous
        _held.reset(token)
        previous.write(held.getvalue())
        previous.flush()
