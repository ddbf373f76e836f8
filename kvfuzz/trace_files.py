"""Trace files, every target's: which files are traces, from their bytes alone (what the pytest plugin collects and
the corpus's readers look at); a trace file's JSON read as nothing in it is trusted; its fields checked, each
problem one line naming the field; and a trace written atomically, never over part of itself.

Every trace format (the allocator's ``kvfuzz-trace/1``, :mod:`kvfuzz.saved.trace`; a scheduler's
``kvfuzz-scheduler-trace/1``, :mod:`kvfuzz.scheduler.trace`) says only what its own fields hold; the fields all
share are :mod:`kvfuzz.trace_format`'s, the file beneath this module's. It imports neither torch nor the rest of
kvfuzz, so that pytest's collection of an unrelated session never needs them.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, TypeVar

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


# -- reading a trace file's JSON -----------------------------------------------------------------------------------
#
# A trace comes from anywhere (a bug report, a pull request, a Redis record), so its bytes are checked before any of
# its fields is: at most MAX_FILE_BYTES of UTF-8 JSON, without NaN or Infinity, repeated fields or too deep a nesting.
# Each problem is one line, raised as the format's own error class (``error``), starting with where the bytes came
# from.


class TraceFileError(ValueError):
    """A file that is not a valid trace of its format: each format's own error is one (``TraceError``,
    ``SchedulerTraceError``), its message one line naming the file and the field."""


class Invalid(Exception):
    """One problem with one field of a trace (``field`` is its path: ``config.num_blocks``, ``program[3].rule``);
    a format's reader turns it into its own error, one line naming the file."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}" if field else problem)


def read_json(path: Path, error: type[TraceFileError]) -> Any:
    """The JSON value of the trace file ``path`` (a regular file; checked as :func:`parse_json` checks bytes)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise error(f"{path}: cannot read: not a regular file")
        with open(path, "rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as failure:
        raise error(f"{path}: cannot read: {failure.strerror or failure}") from None
    return parse_json(raw, str(path), error)


def parse_json(raw: bytes, source: str, error: type[TraceFileError]) -> Any:
    """The JSON value of ``raw``, bytes from anywhere (a file, a Redis record), checked as a trace file's bytes are:
    at most 16 MiB of UTF-8 JSON, without NaN or Infinity, repeated fields or too deep a nesting. Raises ``error``,
    one line starting with ``source``."""
    if len(raw) > MAX_FILE_BYTES:
        raise error(f"{source}: over 16 MiB, more than any trace kvfuzz writes")
    if not raw.strip():
        raise error(f"{source}: empty, not a kvfuzz trace")
    encoding = text_encoding(raw)
    if encoding is None:
        bad = utf8_error(raw)
        offset = bad.start if bad is not None else 0
        raise error(
            f"{source}: not UTF-8 text (byte 0x{raw[offset]:02x} at offset {offset}); a kvfuzz trace is UTF-8 JSON"
        )
    if encoding != "UTF-8":
        raise error(f"{source}: {encoding} text; a kvfuzz trace is UTF-8 JSON (re-save the file as UTF-8)")
    try:
        return json.loads(raw.decode("utf-8-sig"), parse_constant=_no_constant, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise error(f"{source}: not a kvfuzz trace: its JSON is nested too deeply") from None
    except Invalid as invalid:
        raise error(f"{source}: not valid JSON: {invalid}") from None
    except ValueError as invalid:  # json.JSONDecodeError, or an integer of more digits than Python converts
        raise error(f"{source}: not valid JSON: {one_line(str(invalid))}") from None


def _no_constant(name: str) -> Any:
    raise Invalid("", f"{name} is not a JSON number")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name, value in pairs:
        if name in fields:
            raise Invalid("", f"the field {show(name)} appears twice in one object")
        fields[name] = value
    return fields


def one_line(text: str) -> str:
    return " ".join(text.split())


def show(value: Any) -> str:
    """A value in an error message: its JSON, on one line and short."""
    try:
        shown = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        shown = type(value).__name__
    return shown if len(shown) <= 60 else shown[:57] + "..."


# -- checking its fields -------------------------------------------------------------------------------------------


def fields(value: Any, where: str, names: dict[str, bool]) -> dict[str, Any]:
    """``value`` as an object with exactly these fields (name -> required)."""
    if not isinstance(value, dict):
        raise Invalid(where, f"must be a JSON object, not {show(value)}")
    prefix = f"{where}." if where else ""
    for name in value:
        if name not in names:
            raise Invalid(
                f"{prefix}{name}", f"unknown field (a trace's {where or 'top level'} has only: {', '.join(names)})"
            )
    for name, required in names.items():
        if required and name not in value:
            raise Invalid(f"{prefix}{name}", "missing")
    return value


def integer(field: str, value: Any, low: int, high: int, why: str = "") -> int:
    if type(value) is not int:  # bool is an int to Python, not to a trace
        raise Invalid(field, f"must be an integer, not {show(value)}")
    if not low <= value <= high:
        raise Invalid(field, f"{show(value)} is not between {low} and {high}{why}")
    return value


def number(field: str, value: Any, high: float) -> float:
    """A positive number no larger than ``high`` (an integer or a fraction)."""
    if type(value) not in (int, float):
        raise Invalid(field, f"must be a number, not {show(value)}")
    if not 0 < value <= high:
        raise Invalid(field, f"{show(value)} is not above 0 and at most {high:g}")
    return float(value)


def string(field: str, value: Any, longest: int, optional: bool = False) -> Optional[str]:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise Invalid(field, f"must be a string{' or null' if optional else ''}, not {show(value)}")
    if len(value) > longest:
        raise Invalid(field, f"longer than {longest} characters")
    return value


def boolean(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise Invalid(field, f"must be true or false, not {show(value)}")
    return value


def choice(field: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise Invalid(field, f"must be one of {', '.join(choices)}, not {show(value)}")
    return value


# -- writing a trace file ------------------------------------------------------------------------------------------


class Digested(Protocol):
    """A trace as saving compares it with a file of its name: its JSON, its file name, its digest."""

    def to_json(self) -> dict[str, Any]: ...

    def file_name(self) -> str: ...

    def digest(self) -> str: ...


Trace = TypeVar("Trace", bound=Digested)


def save_trace(
    trace: Trace, directory: Path, load: Callable[[Path], Trace], error: type[TraceFileError]
) -> tuple[Path, bool]:
    """Write ``trace`` into ``directory`` (:func:`save_json`) unless a file of its name already holds it: one that
    ``load`` reads (``error`` when it cannot) as a trace of the same digest; returns (path, written)."""

    def saved(path: Path) -> bool:
        try:
            return load(path).digest() == trace.digest()
        except error:
            return False

    return save_json(trace.to_json(), directory / trace.file_name(), saved)


def save_json(record: dict[str, Any], path: Path, saved: Callable[[Path], bool]) -> tuple[Path, bool]:
    """Write ``record`` as the trace file ``path`` unless ``saved(path)`` says the same failure is already there;
    returns (path, written). ``saved`` is the format's own judgement (a file that loads as a trace with the same
    digest): an empty, truncated or damaged file is replaced.

    The record is written to a temporary file in the same directory, flushed and synced, then renamed over the final
    name, so that name never holds part of a trace; the directory is synced after (best effort). A name that holds
    something other than a regular file or a link (a FIFO, a device, a socket, planted in a shared corpus) is never
    renamed over: ``OSError``, as for a directory that cannot be created or written, leaving no temporary file
    behind."""
    if path.exists() and saved(path):
        return path, False
    text = json.dumps(record, indent=2) + "\n"
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode) and not stat.S_ISLNK(mode):
            raise FileExistsError(errno.EEXIST, "not a regular file, which kvfuzz will not replace", str(path))
    temporary = directory / f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp"  # not *.json: never collected
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _sync_directory(directory)
    return path, True


def _sync_directory(directory: Path) -> None:
    """Make the rename durable too, where the platform allows it (best effort: the file itself is synced)."""
    with contextlib.suppress(OSError, AttributeError):
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
