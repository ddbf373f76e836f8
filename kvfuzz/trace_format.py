"""Every trace format's envelope: the fields all targets' traces share, read, checked, digested and saved here once.

A trace file is one JSON object: ``format`` names its format and version (``kvfuzz-trace/1``, an allocator's;
``kvfuzz-scheduler-trace/1``, a scheduler target's), ``kvfuzz_version`` the kvfuzz that wrote it, ``program`` and
``failure`` the target's program and what broke, ``known_bug`` and ``fixed`` its status. A target's format
(:class:`TraceFormat`) names its own top-level fields (which allocator or scheduler, its configuration, its engine)
and builds its trace from the checked object; it never reads the envelope's fields itself. The bytes beneath are
:mod:`kvfuzz.trace_files`'.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Generic, Optional

import attrs

from kvfuzz import trace_files
from kvfuzz.trace_files import Invalid, Trace, TraceFileError, show

ENVELOPE_FIELDS = {
    "format": True,
    "kvfuzz_version": False,
    "program": True,
    "failure": True,
    "known_bug": False,
    "fixed": False,
}
"""The top-level fields every format has (field -> required); ``program`` and ``failure`` a target reads."""
MAX_VERSION_TEXT = 1000
"""Characters of ``kvfuzz_version``."""
MAX_STATUS_TEXT = 100_000
"""Characters of a trace's ``known_bug`` or ``fixed`` text."""
UNKNOWN_VERSION = "unknown"
"""``kvfuzz_version`` of a trace file that does not record it (the earliest allocator traces)."""


@attrs.frozen
class Envelope:
    """A checked trace's common fields besides its program and failure: who wrote it and the bug's status, never
    both ``known_bug`` (why the failure is expected: an engine's unfixed bug) and ``fixed`` (the fix of a bug the
    trace recorded: the failure coming back is a regression)."""

    kvfuzz_version: str
    known_bug: Optional[str]
    fixed: Optional[str]


@attrs.frozen
class TraceFormat(Generic[Trace]):
    """One kind of trace file: ``tag`` the ``format`` field this kvfuzz writes (``name/version``), the top-level
    fields its target adds to :data:`ENVELOPE_FIELDS` (field -> required), the error its files raise (one line
    naming the file and the field), and ``build``: the target's trace from a checked object (all its fields known,
    the required ones present) and its envelope, raising :class:`~kvfuzz.trace_files.Invalid` for a bad field."""

    tag: str = attrs.field(validator=lambda _, __, tag: _split(tag))
    kind: str  # what a person calls the format's files ("kvfuzz trace", "scheduler trace")
    fields: Mapping[str, bool]
    error: type[TraceFileError]
    build: Callable[[dict[str, Any], Envelope], Trace]

    @property
    def name(self) -> str:
        """The format's name, every version's."""
        return _split(self.tag)[0]

    @property
    def version(self) -> int:
        """The version this kvfuzz reads and writes."""
        return _split(self.tag)[1]

    def names(self, data: Any) -> bool:
        """Whether ``data`` (any JSON value) says it is of this format, at any version: what tells the formats apart
        where a trace arrives as JSON rather than as a file (a shared finding in Redis)."""
        written = data.get("format") if isinstance(data, dict) else None
        matched = _VERSIONED.fullmatch(written) if isinstance(written, str) else None
        return matched is not None and matched.group(1) == self.name

    def load(self, path: Path) -> Trace:
        """Read and check the trace file ``path``: its bytes as :func:`kvfuzz.trace_files.read_json` checks every
        trace file's, then its fields. Raises :attr:`error`, one line naming the file and the field."""
        return self.from_json(trace_files.read_json(Path(path), self.error), str(path))

    def from_json(self, data: Any, source: str = "trace") -> Trace:
        """The trace of a JSON value (a file's, a journal's, a Redis record's), checked as :meth:`load` checks a
        file; ``source`` starts each error's line."""
        try:
            return self.build(*self._checked(data))
        except Invalid as error:
            raise self.error(f"{source}: {trace_files.one_line(str(error))}") from None
        except TraceFileError as error:  # a target's own refusal (an allocator trace for a device this one lacks)
            raise type(error)(f"{source}: {error}") from None

    def save(self, trace: Trace, directory: Path) -> tuple[Path, bool]:
        """Write ``trace`` into ``directory`` unless a file of its name already holds the same failure (one that
        loads as a trace of the same digest); returns (path, written). Written atomically
        (:func:`kvfuzz.trace_files.save_json`); raises ``OSError`` when the directory cannot be created or written,
        leaving no temporary file behind."""
        return trace_files.save_trace(trace, directory, self.load, self.error)

    def _checked(self, data: Any) -> tuple[dict[str, Any], Envelope]:
        if not isinstance(data, dict):
            raise Invalid("", f"not a {self.kind}: the file holds a JSON {type(data).__name__}, not a JSON object")
        written = data.get("format")
        matched = _VERSIONED.fullmatch(written) if isinstance(written, str) else None
        if matched is not None and matched.group(1) == self.name and int(matched.group(2)) > self.version:
            raise Invalid("", f"written by a newer kvfuzz (format {written}); this kvfuzz reads {self.tag}")
        if written != self.tag:
            found = "no format field" if "format" not in data else f'"format" is {show(written)}'
            raise Invalid("", f'not a {self.kind} ({found}; expected "format": "{self.tag}")')
        checked = trace_files.fields(data, "", {**ENVELOPE_FIELDS, **self.fields})
        version = trace_files.string("kvfuzz_version", checked.get("kvfuzz_version", UNKNOWN_VERSION), MAX_VERSION_TEXT)
        assert version is not None
        if not version.isprintable():
            raise Invalid("kvfuzz_version", f"{show(version)} holds control characters")
        known_bug = trace_files.string("known_bug", checked.get("known_bug"), MAX_STATUS_TEXT, optional=True)
        fixed = trace_files.string("fixed", checked.get("fixed"), MAX_STATUS_TEXT, optional=True)
        if known_bug and fixed:
            raise Invalid("fixed", "a trace of a fixed bug cannot be a known (unfixed) bug too: clear known_bug")
        return checked, Envelope(version, known_bug, fixed)


_VERSIONED = re.compile(r"([a-z][a-z0-9-]{0,99})/([0-9]{1,9})")


def _split(tag: str) -> tuple[str, int]:
    """A format's name and version, from its tag (``kvfuzz-trace/1``)."""
    matched = _VERSIONED.fullmatch(tag)
    if matched is None:
        raise ValueError(f"a format's tag is NAME/VERSION, not {tag!r}")
    return matched.group(1), int(matched.group(2))


def digest(key: Any) -> str:
    """A failure's digest, every format's: the first 12 hex digits of the SHA-256 of ``key`` (what identifies the
    failure: its target, configuration and program) as sorted JSON."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
