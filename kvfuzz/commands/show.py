"""``kvfuzz show TRACE``: replay a trace and draw its timeline, as an HTML page and, with the plot extra, a PNG.

Without ``--html`` the page is written beside the trace, named after it (``NAME.html``). A file
that is not a valid trace (a newer format, a corrupt file) is one line on standard error and exit status 2, before
any replay; a trace of more than 10,000 calls is drawn as the window of its last 10,000 calls, and the page says so.
The exit status is otherwise 0: showing a failure is not one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvfuzz.commands.options import needs_torch
from kvfuzz.commands.output_files import OutputNotWritten, check_outputs, write_text, written_atomically
from kvfuzz.registry import AllocatorNotFound, AllocatorTrust, load_factory
from kvfuzz.saved.hint import default_page
from kvfuzz.text import printable, printable_lines


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "show", help="draw a trace's timeline: blocks over calls, as an HTML page (and a PNG with the plot extra)"
    )
    parser.add_argument("trace", metavar="TRACE")
    parser.add_argument("--html", metavar="OUT.html", help="write the page here (default: NAME.html beside the trace)")
    parser.add_argument("--png", metavar="OUT.png", help="also draw the timeline as a PNG (needs matplotlib)")
    parser.add_argument("--allocator", help="replay against this allocator instead of the recorded one")
    parser.add_argument(
        "--trust-allocator",
        action="store_true",
        help="replay the allocator the trace names even when it is not registered, a zoo: name or kvfuzz's own "
        "(only for traces from a source you trust)",
    )
    parser.set_defaults(handler=needs_torch(run_command))


def _usage_error(message: str) -> int:
    print(f"kvfuzz: {message}", file=sys.stderr)
    return 2


def run_command(args: argparse.Namespace) -> int:
    from kvfuzz.commands import scheduler_traces

    if scheduler_traces.is_scheduler_trace(args.trace):
        return scheduler_traces.show(args.trace, args.html, args.png, args.allocator)
    from kvfuzz.saved.trace import TraceError
    from kvfuzz.saved.trace import load as load_trace

    try:
        trace = load_trace(Path(args.trace))
    except TraceError as error:
        return _usage_error(str(error))
    page = Path(args.html) if args.html else default_page(Path(args.trace))
    try:  # the default page too: a trace named NAME.html is its own default page
        check_outputs({"--html": str(page), "--png": args.png}, {"TRACE": args.trace})
    except ValueError as error:
        return _usage_error(str(error))
    if args.png is not None:
        try:
            import matplotlib  # noqa: F401 -- only whether the plot extra is installed
        except ImportError:
            return _usage_error("--png needs matplotlib: pip install 'kvfuzz[plot]'")
    if args.allocator is not None:
        try:
            load_factory(args.allocator)
        except AllocatorNotFound as error:
            return _usage_error(str(error))
    from kvfuzz.timeline.html import render_html
    from kvfuzz.timeline.record import record

    name = printable(args.trace)  # a file name that is not UTF-8 prints (and goes into the page) escaped
    started = time.perf_counter()
    try:
        timeline = record(trace, name, args.allocator, trust=AllocatorTrust(everything=args.trust_allocator))
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # building the allocator or its engine failed or exited: one line, as replay says
        one_line = " ".join(f"{type(error).__name__}: {error}".split())
        return _usage_error(f"{name}: replay could not start: {one_line}")
    try:
        write_text(page, render_html(timeline))
        if args.png is not None:
            from kvfuzz.timeline.png import render_png

            with written_atomically(Path(args.png)) as picture:
                render_png(timeline, picture)
    except OutputNotWritten as error:
        return _usage_error(str(error))
    for note in timeline.notes:
        print(f"note: {printable_lines(note)}")
    outcome = timeline.outcome
    where = f" at call {timeline.columns[outcome.column].call_index + 1}" if outcome.column is not None else ""
    print(f"{name}: {printable(outcome.title)}: {outcome.verdict}{where} against {timeline.allocator}")
    pictures = f"{printable(str(page))}" + (f" and {printable(args.png)}" if args.png else "")
    print(f"timeline: {pictures} ({time.perf_counter() - started:.2f} s)")
    return 0
