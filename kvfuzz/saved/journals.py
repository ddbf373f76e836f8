"""Recovering the failure of a run its target killed: a journal (:class:`kvfuzz.program.safeguards.Journal`) left
by a process that no longer exists holds the program it was running when it died; it becomes a trace of its target
in the same corpus (an allocator trace, or a scheduler trace when its header names a scheduler), labelled as a crash
of the process, and the journal is removed.

Every command that saves traces into a corpus recovers that corpus's journals before doing anything else.
"""

from __future__ import annotations

import errno
import io
import json
import os
import stat
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import attrs

from kvfuzz.program.safeguards import JOURNAL_FORMAT, JOURNAL_PREFIX
from kvfuzz.saved.corpus import PROCESS_DIED
from kvfuzz.saved.trace import FORMAT, MAX_PROGRAM_CALLS, TraceError, from_json, save
from kvfuzz.scheduler import trace as scheduler_trace
from kvfuzz.text import printable
from kvfuzz.trace_files import MAX_FILE_BYTES


def process_alive(pid: int) -> bool:
    """Whether the process ``pid`` runs (one of another user's counts); a zombie (dead, its parent not yet told, as
    a killed campaign's worker is until it is reaped) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            return stat_file.read().rpartition(b")")[2].split()[:1] != [b"Z"]
    except OSError:
        return True  # no /proc here: it exists


MAX_READ = MAX_FILE_BYTES
"""The most of a journal recovery reads after its first line: its last 16 MiB (a trace file's limit: a program whose
calls take more could never be loaded as a trace). A run starts its journal afresh once it passes
:data:`kvfuzz.program.safeguards.JOURNAL_LIMIT`, so its own journals stay far below; a larger file (an old kvfuzz's,
or planted in a shared corpus) is read from its tail only, never whole."""
MAX_HEADER = 64 * 1024
"""The most of a large journal's first line recovery reads: a header is well under 1 KiB; a longer first line is not
one, and the rest of it is never read."""


class NotAJournal(OSError):
    """The journal's name holds something that is not a regular file (a link, a FIFO, a device): left alone."""


def _journal_lines(journal: Path) -> Iterator[bytes]:
    """The journal's lines as recovery needs them: all of a file up to :data:`MAX_READ` bytes; of a larger one, its
    first line (up to :data:`MAX_HEADER` bytes), then the lines that start in its last :data:`MAX_READ` bytes (the
    partial first one skipped). The name is opened without following a link and without waiting (a FIFO), and read
    only if it is a regular file (:class:`NotAJournal` otherwise): never more than those bytes, whatever it is."""
    try:
        descriptor = os.open(journal, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise NotAJournal(f"{printable(str(journal))} is a symbolic link, not a journal: left alone") from None
        raise
    with open(descriptor, "rb") as stream:
        found = os.fstat(stream.fileno())
        if not stat.S_ISREG(found.st_mode):
            raise NotAJournal(f"{printable(str(journal))} is not a regular file, not a journal: left alone")
        if found.st_size > MAX_READ:
            first = stream.readline(MAX_HEADER)
            if first.endswith(b"\n"):
                yield first
            stream.seek(found.st_size - MAX_READ)
            stream.readline(MAX_READ)  # the rest of a line that started before the tail
        yield from io.BytesIO(stream.read(MAX_READ))  # line by line, the tail read once


def _last_program(lines: Iterable[bytes]) -> tuple[Optional[dict[str, Any]], list[dict[str, Any]]]:
    # A program of no calls is kept: the process died building the allocator or tearing the example down.
    """The journal's header and the calls of its last program (a torn last line, written as the process died, is
    dropped); a program over :data:`MAX_PROGRAM_CALLS` calls, which no trace may hold, keeps only its first ones
    plus one (held in memory no further), so that the trace it would become is refused as too long."""
    header: Optional[dict[str, Any]] = None
    program: list[dict[str, Any]] = []
    for line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested too deeply
            continue
        if not isinstance(record, dict):
            continue
        if record.get("format") == JOURNAL_FORMAT:
            header = record
        elif "example" in record:
            program = []
        elif ("rule" in record or "op" in record) and len(program) <= MAX_PROGRAM_CALLS:
            program.append(record)  # an allocator's call, or a scheduler's operation
    return header, program


def last_program(journal: Path) -> tuple[Optional[dict[str, Any]], list[dict[str, Any]]]:
    """The header and the calls of the last program ``journal`` holds (None: no header, nothing ran), read within
    the bounds recovery keeps (:class:`NotAJournal`, ``OSError``)."""
    return _last_program(_journal_lines(journal))


@attrs.frozen
class Recovered:
    """One journal of a process that died, handled."""

    pid: int  # the process that wrote it
    trace: Optional[Path]  # the trace it became; None when it could not become one (the message says why)
    message: str  # one line for a person: where the trace is, or why there is none


def recover(directory: Path) -> list[Recovered]:
    """Turn every journal in ``directory`` whose process is gone into a trace; returns one record per journal
    handled: the trace it became, or why it could not become one."""
    handled: list[Recovered] = []
    for journal in sorted(directory.glob(f"{JOURNAL_PREFIX}*.jsonl")):
        try:
            pid = int(journal.stem[len(JOURNAL_PREFIX) :])
        except ValueError:
            continue
        if pid != os.getpid() and process_alive(pid):
            continue  # another run is using it
        try:
            header, program = last_program(journal)
        except NotAJournal as error:
            handled.append(Recovered(pid, None, str(error)))
            continue
        except OSError as error:
            handled.append(Recovered(pid, None, f"could not read {journal}: {error}"))
            continue
        if header is None or ("scheduler" in header and "config" not in header):
            # the process died before it wrote the header, or before a scheduler's first example: nothing ran
            journal.unlink(missing_ok=True)
            continue
        if "scheduler" in header:
            handled.append(_scheduler_trace(directory, journal, pid, header, program))
            continue
        last = program[-1] if program else {"rule": "teardown"}
        where = f"call {len(program)}, {last.get('rule')}," if program else "the allocator's construction or teardown"
        data = {
            "format": FORMAT,
            "allocator": header.get("allocator"),
            "config": header.get("config"),
            "program": program,
            "failure": {
                "invariant": None,
                "title": PROCESS_DIED,
                "operation": f"{last.get('rule')}",
                "explanation": (
                    f"the kvfuzz process (pid {pid}) died during {where} of this program (a segfault, an abort or "
                    "a kill in the allocator): replay it to see how"
                ),
            },
            "known_bug": None,
        }
        try:
            path, _ = save(from_json(data), directory)
        except (TraceError, OSError) as error:
            message = f"the journal {journal} of a run that died could not become a trace: {error}"
            handled.append(Recovered(pid, None, message))
            continue
        journal.unlink(missing_ok=True)
        handled.append(Recovered(pid, path, f"recovered the program a run that died (pid {pid}) was running: {path}"))
    return handled


def _scheduler_trace(
    directory: Path, journal: Path, pid: int, header: dict[str, Any], program: list[dict[str, Any]]
) -> Recovered:
    """A scheduler target's journal (its header names the scheduler), as a scheduler trace in ``directory``."""
    last = program[-1].get("op") if program else None
    where = f"operation {len(program)}, {last}," if program else "the engine's construction"
    message = f"the process (pid {pid}) died during {where} of this program (a segfault, an abort or a kill)"
    try:
        path, _ = scheduler_trace.save(scheduler_trace.from_journal(header, program, message), directory)
    except (scheduler_trace.SchedulerTraceError, OSError) as error:
        return Recovered(pid, None, f"the journal {journal} of a run that died could not become a trace: {error}")
    journal.unlink(missing_ok=True)
    return Recovered(pid, path, f"recovered the program a run that died (pid {pid}) was running: {path}")
