"""``kvfuzz show TRACE``: replay a trace and draw its timeline, as an HTML page and, with the plot extra, a PNG.

Without ``--html`` the page is written beside the trace, named after it (``NAME.html``). A file
that is not a valid trace (a newer format, a corrupt file) is one line on standard error and exit status 2, before
any replay; a trace of more than 10,000 calls is drawn as the window of its last 10,000 calls, and the page says so.
The exit status is otherwise 0: showing a failure is not one.
"""

from __future__ import annotations

import argparse

from kvfuzz.commands.options import needs_torch


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


def run_command(args: argparse.Namespace) -> int:
    from kvfuzz.commands.trace_kinds import kind_of

    return kind_of(args.trace).show(args)
