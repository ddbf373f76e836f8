"""Which files are kvfuzz traces, from their bytes alone: what the pytest plugin collects and the corpus's readers
look at. It imports neither torch nor the rest of kvfuzz, so that pytest's collection of an unrelated session never
needs them; reading and checking a trace is :mod:`kvfuzz.saved.trace`."""

from __future__ import annotations

import codecs
import json
import os
import stat
from pathlib import Path
from typing import Optional

FORMAT = "kvfuzz-trace/1"
SCHEDULER_FORMAT = "kvfuzz-scheduler-trace/1"
"""A scheduler target's trace (:mod:`kvfuzz.scheduler.trace`, whose ``FORMAT`` it is): its own kind of file."""
MAX_FILE_BYTES = 16 * 2**20
"""The largest trace file read: the biggest shrunk programs are a few hundred calls, a few hundred KiB."""


def text_encoding(raw: bytes) -> Optional[str]:
    """The encoding of a JSON file's bytes, cheaply: ``UTF-8`` (a byte-order mark allowed), ``UTF-16`` or ``UTF-32``
    (with a byte-order mark, or the zero bytes of ASCII JSON text), or None if the bytes decode as none of them."""
    boms = (
        (codecs.BOM_UTF32_LE, "utf-32", "UTF-32"),  # before UTF-16's: it begins with the same two bytes
        (codecs.BOM_UTF32_BE, "utf-32", "UTF-32"),
        (codecs.BOM_UTF16_LE, "utf-16", "UTF-16"),
        (codecs.BOM_UTF16_BE, "utf-16", "UTF-16"),
    )
    wide = next(((codec, name) for bom, codec, name in boms if raw.startswith(bom)), None)
    if wide is None and b"\x00" in raw[:4]:
        codec = json.detect_encoding(raw)
        wide = (codec, codec[:6].upper()) if codec.startswith("utf-") and codec[4:6] in ("16", "32") else None
    if wide is not None:
        try:
            raw.decode(wide[0])
            return wide[1]
        except UnicodeDecodeError:
            pass
    return "UTF-8" if utf8_error(raw) is None else None


def utf8_error(raw: bytes) -> Optional[UnicodeDecodeError]:
    try:
        raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        return error
    return None


TRACE_MARKERS = tuple(
    FORMAT.split("/")[0].encode(codec) for codec in ("utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be")
)
"""``kvfuzz-trace`` as bytes in each encoding :func:`text_encoding` recognises."""

SCHEDULER_TRACE_MARKERS = tuple(
    SCHEDULER_FORMAT.split("/")[0].encode(codec)
    for codec in ("utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be")
)
"""``kvfuzz-scheduler-trace`` likewise."""


def json_file_kind(path: Path) -> Optional[str]:
    """What the pytest plugin makes of a file, from its bytes (the first 16 MiB): None unless it is a regular
    ``.json`` file; ``"trace"`` if its bytes hold ``kvfuzz-trace`` in UTF-8, UTF-16 or UTF-32, wherever it stands
    (formatting and key order do not matter), or ``"scheduler-trace"`` if they hold ``kvfuzz-scheduler-trace`` (a
    scheduler target's trace, looked for first); ``"undecodable"`` if the bytes are no text :func:`text_encoding`
    recognises; ``"other"`` for any other JSON file (a workload, a ``package.json``)."""
    if path.suffix != ".json":
        return None
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        with open(path, "rb") as handle:
            raw = handle.read(MAX_FILE_BYTES)
    except OSError:
        return None
    if any(marker in raw for marker in SCHEDULER_TRACE_MARKERS):
        return "scheduler-trace"
    if any(marker in raw for marker in TRACE_MARKERS):
        return "trace"
    return "undecodable" if text_encoding(raw) is None else "other"


def is_trace_file(path: Path) -> bool:
    """Whether ``path`` is a ``.json`` file whose bytes name the allocator trace format (see
    :func:`json_file_kind`)."""
    return json_file_kind(path) == "trace"
