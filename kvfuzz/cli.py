"""The ``kvfuzz`` command line: each subcommand's module registers its parser and handler; ``main`` dispatches."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

from kvfuzz.accounting import command as account
from kvfuzz.commands import export, replay, run, zoo
from kvfuzz.workload import command as replay_workload

# In the order ``kvfuzz --help`` lists them.
COMMANDS = (run, replay, export, zoo, account, replay_workload)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfuzz", description="Fuzz-test a paged KV-cache allocator.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
