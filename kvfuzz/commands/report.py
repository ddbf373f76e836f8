"""``kvfuzz report TRACE``: what an engine maintainer needs to act on a failure, in one Markdown file: the engine and
its version, kvfuzz's version and the command that searches that configuration, the configuration, the shrunk
program, the explanation, the timeline, the version it was replayed on here, and a standalone reproducer that
imports only the engine (:mod:`kvfuzz.reproducers`: for scheduler traces vLLM's :mod:`kvfuzz.scheduler.reproducer`
or SGLang's :mod:`kvfuzz.reproducers.sglang_scheduler`, and a family per allocator adapter), also written beside the
report as a Python file.

The report is written to ``-o`` (default ``NAME.md`` in the current directory), the reproducer to ``NAME_reproducer.py``
beside it. A file that is not a trace, or cannot be read, is one line and exit status 2 before anything is written.
A trace no reproducer is generated for (a check that needs kvfuzz's reference, a kvfuzz allocator) gets a report
that says why and names the replay and the exported test instead. Where the trace's engine is installed the trace
is replayed (every check on) for the timeline and the verdict; elsewhere the report says it was not."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvfuzz.commands.options import needs_torch
from kvfuzz.commands.output_files import OutputNotWritten, check_outputs, write_text
from kvfuzz.text import printable


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "report", help="write a trace's report for the engine's maintainers, with a standalone reproducer"
    )
    parser.add_argument("trace", metavar="TRACE")
    parser.add_argument("-o", "--output", metavar="OUT.md", help="the report (default: NAME.md here)")
    parser.set_defaults(handler=needs_torch(run_command))


def _usage_error(message: str) -> int:
    print(f"kvfuzz: {printable(message)}", file=sys.stderr)
    return 2


def reproducer_path(report: Path) -> Path:
    """Where the reproducer of the report ``report`` is written: beside it, ``NAME_reproducer.py``."""
    return report.with_name(f"{report.stem}_reproducer.py")


def run_command(args: argparse.Namespace) -> int:
    from kvfuzz.commands.trace_kinds import kind_of
    from kvfuzz.trace_files import TraceFileError

    path = Path(args.trace)
    report = Path(args.output) if args.output else Path(path.stem + ".md")
    try:
        check_outputs({"-o": str(report), "reproducer": str(reproducer_path(report))}, {"TRACE": args.trace})
    except ValueError as error:
        return _usage_error(str(error))
    try:
        text, reproducer = kind_of(args.trace).report(args.trace)
    except TraceFileError as error:
        return _usage_error(str(error))
    try:
        if reproducer is not None:
            write_text(reproducer_path(report), reproducer)
        write_text(report, text)
    except OutputNotWritten as error:
        return _usage_error(str(error))
    written = f" and {reproducer_path(report)}" if reproducer is not None else ""
    print(f"report: {report}{written}")
    return 0
