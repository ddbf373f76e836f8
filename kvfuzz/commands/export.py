"""``kvfuzz export``: a saved trace as a standalone pytest file. A file that is not a valid trace, and an ``-o`` that
is the trace itself or cannot be written, are refused with one line and exit status 2, and nothing is written.

The exported test imports and calls the allocator the trace names, so the trust policy of ``kvfuzz replay`` applies
(:class:`kvfuzz.registry.AllocatorTrust`): a trace naming a ``MODULE:FACTORY`` that is not registered, a ``zoo:``
name or kvfuzz's own is refused in one line, unless ``--trust-allocator`` says its source is trusted or
``--allocator`` names the allocator to test instead."""

from __future__ import annotations

import argparse

from kvfuzz.commands.options import needs_torch


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("export", help="write a trace as a standalone pytest file")
    parser.add_argument("trace", metavar="FILE")
    parser.add_argument("--allocator", help="test this allocator instead of the recorded one")
    parser.add_argument(
        "--trust-allocator",
        action="store_true",
        help="export a test of the allocator the trace names even when it is not registered, a zoo: name or "
        "kvfuzz's own (only for traces from a source you trust: running the test calls it)",
    )
    parser.add_argument("-o", "--output", help="the file to write (default: stdout)")
    parser.set_defaults(handler=needs_torch(run_command))


def run_command(args: argparse.Namespace) -> int:
    from kvfuzz.commands.trace_kinds import kind_of

    return kind_of(args.trace).export(args)
