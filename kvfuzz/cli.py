"""The ``kvfuzz`` command line: each subcommand's module registers its parser and handler; ``main`` dispatches.

Bad usage is one line on standard error, ``kvfuzz: ...``, and exit status 2, before any work: argparse's own errors
(an unknown option, a value of the wrong type or out of range) as well as the checks each command makes. Ctrl-C in
a command that does not handle it itself (``run`` and ``campaign`` report what they found) is one line and exit
status 130, not a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, NoReturn, Optional, Sequence

from kvfuzz.commands import account, campaign, export, replay, replay_workload, run, serving, show, zoo

# In the order ``kvfuzz --help`` lists them.
COMMANDS = (run, campaign, replay, show, export, zoo, account, replay_workload, serving)

# Arguments (by dest) that name a file a command writes, and how the user spelled them: the directory must exist.
OUTPUT_FILES = {"output": "-o", "plot": "--plot"}


class UsageError(Exception):
    """Bad usage: the message is the one line printed after ``kvfuzz: ``."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line, ``kvfuzz: ...`` (with where to find help), and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvfuzz: {' '.join(message.split())} (see: {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvfuzz", description="Fuzz-test a paged KV-cache allocator.")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def check_output_files(args: argparse.Namespace) -> None:
    """Every file the command will write goes into a directory that exists: checked before it runs, not after."""
    for dest, flag in OUTPUT_FILES.items():
        value = getattr(args, dest, None)
        if not value:
            continue
        path = Path(value)
        if path.is_dir():
            raise UsageError(f"{flag} {value}: is a directory; name the file to write")
        if not path.resolve().parent.is_dir():
            raise UsageError(f"{flag} {value}: directory {path.parent} does not exist")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command; returns its exit status (2 on bad usage, after one line on standard error)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as stop:  # --help (0) or a usage error (2), already printed
        return stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 2
    try:
        check_output_files(args)
    except UsageError as error:
        print(f"kvfuzz: {error}", file=sys.stderr)
        return 2
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        print(f"\nkvfuzz: {args.command} interrupted (Ctrl-C) before it finished: nothing to report", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
