"""The ``kvfuzz`` command line: each subcommand's module registers its parser and handler; ``main`` dispatches.

Bad usage is one line on standard error, ``kvfuzz: ...``, and exit status 2, before any work: argparse's own errors
(an unknown option, a value of the wrong type or out of range) as well as the checks each command makes. With
``--json``, standard output carries the command's JSON and nothing else (:mod:`kvfuzz.commands.json_stdout`). Ctrl-C
in a command that does not handle it itself (``run`` and ``campaign`` report what they found) is one line and exit
status 130, not a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn, Optional, Sequence

from kvfuzz.commands import (
    account,
    campaign,
    export,
    findings,
    replay,
    replay_workload,
    report,
    run,
    serving,
    show,
    zoo,
)
from kvfuzz.commands.json_stdout import stdout_for_json_only
from kvfuzz.commands.output_files import check_outputs

# In the order ``kvfuzz --help`` lists them.
COMMANDS = (run, campaign, findings, replay, show, export, report, zoo, account, replay_workload, serving)

# Arguments (by dest) that name a file a command writes, and how the user spelled them: the directory must exist,
# and none may be a file the command reads (INPUT_FILES) or the file of another output.
OUTPUT_FILES = {"output": "-o", "plot": "--plot", "html": "--html", "png": "--png"}

# Arguments (by dest) that name a file a command reads (a trace, a workload), and how --help names them.
INPUT_FILES = {"trace": "TRACE"}


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
    """Every file the command will write goes into a directory that exists and is none of the files it reads:
    checked before it runs, not after (:func:`~kvfuzz.commands.output_files.check_outputs`)."""
    try:
        check_outputs(
            {flag: getattr(args, dest, None) for dest, flag in OUTPUT_FILES.items()},
            {name: getattr(args, dest, None) for dest, name in INPUT_FILES.items()},
        )
    except ValueError as error:
        raise UsageError(str(error)) from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command; returns its exit status (2 on bad usage, after one line on standard error). Text the
    terminal's encoding cannot hold (a file name that is not UTF-8 comes in with surrogate escapes) is printed as
    its escape, never a ``UnicodeEncodeError``."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
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
        if getattr(args, "json", False):  # standard output carries the command's JSON alone, whatever else prints
            with stdout_for_json_only():
                return handler(args)
        return handler(args)
    except KeyboardInterrupt:
        print(f"\nkvfuzz: {args.command} interrupted (Ctrl-C) before it finished: nothing to report", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
