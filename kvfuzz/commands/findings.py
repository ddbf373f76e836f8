"""``kvfuzz findings``: the findings that campaigns on every machine stored in one Redis
(:mod:`kvfuzz.campaign.cluster`), listed one line each, and written as trace files that ``kvfuzz replay`` accepts.

``KEY`` arguments (a signature key as the list shows it, or a prefix that names one key alone) select findings;
without any, every finding. ``-o DIR`` writes the selected findings' traces into DIR, each under the name a campaign
gives it. Bad input is one line and exit status 2 before anything is written: a ``--database`` that is not a
``redis://HOST:PORT/N`` URL or whose server does not answer, a KEY that names no finding (or several), an ``-o``
that is a file. A stored record is untrusted input: one that is not a valid finding (its trace fails the checks a
trace file passes), or larger than kvfuzz reads (16 MiB a record, 64 MiB in all), is reported on one line and
neither listed nor written, and the exit status is then 2, as it is for keys longer than any finding's (counted on
the server, never read); a server holding more findings than kvfuzz lists is refused. Every read of the server,
together, has ``--timeout`` seconds: a server that answers slowly, or a byte at a time, is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

from kvfuzz.commands.json_stdout import emit_json
from kvfuzz.commands.options import at_least_seconds, needs_torch
from kvfuzz.text import printable
from kvfuzz.trace_saving import trusting


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "findings", help="list the findings campaigns stored in a Redis, and write them as trace files"
    )
    parser.add_argument(
        "keys",
        nargs="*",
        metavar="KEY",
        help="the findings to list or write: a key as listed, or a prefix naming one (default: every finding)",
    )
    parser.add_argument(
        "--database", required=True, metavar="redis://HOST:PORT/N", help="the Redis the campaigns shared"
    )
    parser.add_argument(
        "-o", "--output-dir", dest="directory", metavar="DIR", help="write each finding's trace into DIR"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument(
        "--timeout",
        type=at_least_seconds,
        default=READ_DEADLINE,
        metavar="SECONDS",
        help=f"how long reading the server may take, all reads together (default {READ_DEADLINE:g})",
    )
    parser.set_defaults(handler=needs_torch(run_command))


READ_DEADLINE = 60.0
"""Seconds every read of the server may take together, by default (``--timeout``)."""


class _Refused(Exception):
    """Bad input: the one line printed after ``kvfuzz: ``, exit status 2."""


class _Expired(BaseException):
    """The reads' deadline passed: a ``BaseException``, so that no client code that catches ``Exception`` (the
    connection check's, the client's retries) takes it for one more network error."""


@contextlib.contextmanager
def _deadline(seconds: float, url: str) -> Iterator[None]:
    """While active, the reads have ``seconds`` in all: past that, a refusal (:class:`_Refused`, one line) leaves the
    block, whatever the client was waiting for (a server trickling its answer keeps each socket read under its own
    timeout)."""

    def expired(signum: int, frame: object) -> None:
        raise _Expired()

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _Expired:
        raise _Refused(f"--database {url}: the server did not answer within {seconds:g} s (--timeout)") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_command(args: argparse.Namespace) -> int:
    from kvfuzz.campaign.cluster import (
        MAX_KEY,
        ClusterFindings,
        StoredFinding,
        TooLarge,
        check_redis_url,
        is_redis,
        parse_finding,
    )
    from kvfuzz.saved.trace import TraceError

    url: str = args.database
    try:
        if not is_redis(url):
            raise _Refused(f"--database {url}: kvfuzz findings reads the Redis campaigns shared: redis://HOST:PORT/N")
        directory = Path(args.directory) if args.directory else None
        if directory is not None and directory.exists() and not directory.is_dir():
            raise _Refused(f"-o {directory}: not a directory")
        with _deadline(args.timeout, url):
            check_redis_url(url)
            cluster = ClusterFindings(url)
            stored = _redis(url, cluster.keys)
            keys = _select(stored.keys, args.keys, url)
            raw = _redis(url, lambda: cluster.fetch(keys))
    except (_Refused, ValueError) as error:
        print(f"kvfuzz: {error}", file=sys.stderr)
        return 2
    status = 0
    if stored.too_long:
        print(
            f"kvfuzz: {url} holds {stored.too_long} key{'s' if stored.too_long != 1 else ''} longer than "
            f"{MAX_KEY} bytes, no finding's: not read",
            file=sys.stderr,
        )
        status = 2
    findings: list[StoredFinding] = []
    for key in keys:
        record = raw.get(key)
        if record is None:
            print(f"kvfuzz: finding {printable(key)}: deleted from {url} while it was read", file=sys.stderr)
            status = 2
            continue
        if isinstance(record, TooLarge):
            print(f"kvfuzz: {url} finding {printable(key)}: {record}; not read", file=sys.stderr)
            status = 2
            continue
        try:
            findings.append(parse_finding(key, record, f"{url} finding {printable(key)}"))
        except TraceError as error:
            print(f"kvfuzz: {error}", file=sys.stderr)
            status = 2
    findings.sort(key=lambda finding: (finding.time, finding.key))
    files: dict[str, str] = {}
    if directory is not None:
        for finding in findings:
            try:
                path = _save(finding.trace, directory)
            except OSError as error:
                print(f"kvfuzz: -o {directory}: cannot write ({error.strerror or error})", file=sys.stderr)
                return 2
            files[finding.key] = str(path)
    if args.json:
        emit_json({"database": url, "findings": [_entry(finding, files.get(finding.key)) for finding in findings]})
    else:
        _table(findings, files, url)
    return status


def _save(trace: Any, directory: Path) -> Path:
    """Write an allocator's or a scheduler's trace as the file its kind has."""
    from kvfuzz.saved.trace import save
    from kvfuzz.scheduler import trace as scheduler_trace

    if isinstance(trace, scheduler_trace.SchedulerTrace):
        return scheduler_trace.save(trace, directory)[0]
    return save(trace, directory)[0]


def _redis(url: str, read: Any) -> Any:
    """``read()``, with the server failing mid-way (it answered the check a moment ago) a refusal of one line."""
    try:
        return read()
    except (_Refused, ValueError):
        raise
    except Exception as error:  # noqa: BLE001 -- whatever the client says, in one line
        raise _Refused(f"--database {url}: cannot read Redis ({' '.join(str(error).split())})") from None


def _select(stored: list[str], wanted: list[str], url: str) -> list[str]:
    """The keys ``wanted`` names (each exactly, or a prefix of one stored key alone), in order and without repeats;
    every stored key when none is wanted."""
    if not wanted:
        return stored
    selected: list[str] = []
    for name in wanted:
        matches = [key for key in stored if key == name] or [key for key in stored if key.startswith(name)]
        if not matches:
            raise _Refused(f"no finding {name} in {url} (kvfuzz findings --database {url} lists them)")
        if len(matches) > 1:
            raise _Refused(f"{name} names {len(matches)} findings in {url}: give more of the key")
        if matches[0] not in selected:
            selected.append(matches[0])
    return selected


def _entry(finding: Any, file: Optional[str]) -> dict[str, Any]:
    trace = finding.trace.to_json()
    return {
        "key": finding.key,
        "signature": finding.signature.to_json(),
        "text": finding.text,
        "allocator": finding.signature.allocator,
        "length": len(finding.trace.program),
        "machine": finding.machine,
        "pid": finding.pid,
        "time": finding.time,
        "seed": finding.seed,
        "worker_seed": finding.worker_seed,
        "trace_file": finding.trace_file,
        "config": trace["config"],
        "file": file,
    }


def _table(findings: list[Any], files: dict[str, str], url: str) -> None:
    if not findings:
        print(f"no findings in {url}")
        return
    rows = [("KEY", "SIGNATURE", "ALLOCATOR", "CALLS", "MACHINE", "TIME")]
    rows += [(f.key, f.text, f.signature.allocator, str(len(f.trace.program)), f.machine, f.time) for f in findings]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)]
        line = "  ".join([*cells, row[-1]])
        print(line + (f"  -> {files[row[0]]}" if row[0] in files else ""))
    print(f"{len(findings)} finding{'s' if len(findings) != 1 else ''} in {url}")
    if files:
        allocators = [f.signature.allocator for f in findings if f.key in files]
        flag = next((trusting(allocator) for allocator in allocators if trusting(allocator)), "")
        print(f"replay them with: kvfuzz replay{flag} {' '.join(shlex.quote(files[f.key]) for f in findings)}")
