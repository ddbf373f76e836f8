"""``kvfuzz export``: a saved trace as a standalone pytest file. A file that is not a valid trace, and an ``-o`` that
is the trace itself or cannot be written, are refused with one line and exit status 2, and nothing is written."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvfuzz.commands.options import needs_torch
from kvfuzz.commands.output_files import write_or_print


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("export", help="write a trace as a standalone pytest file")
    parser.add_argument("trace", metavar="FILE")
    parser.add_argument("--allocator", help="test this allocator instead of the recorded one")
    parser.add_argument("-o", "--output", help="the file to write (default: stdout)")
    parser.set_defaults(handler=needs_torch(run_command))


def run_command(args: argparse.Namespace) -> int:
    from kvfuzz.commands import scheduler_traces

    if scheduler_traces.is_scheduler_trace(args.trace):
        return scheduler_traces.export(args.trace, args.output, args.allocator)
    from kvfuzz.saved.corpus import export_test
    from kvfuzz.saved.trace import TraceError
    from kvfuzz.saved.trace import load as load_trace

    try:
        trace = load_trace(Path(args.trace))
    except TraceError as error:
        print(f"kvfuzz: {error}", file=sys.stderr)
        return 2
    return write_or_print(export_test(trace, args.trace, args.allocator), args.output, "pytest {path}")
