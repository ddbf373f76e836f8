"""``kvfuzz replay``: re-execute saved traces, call by call, without Hypothesis.

Each file is reported on its own and the next one is replayed whatever happened to it (its allocator raising or
exiting while it is imported or built included); several files end with a line counting each outcome and giving
the exit status. The exit status is the worst of the files': 3 for a scheduler trace whose replay kvfuzz's own code
failed (a harness error, :mod:`kvfuzz.scheduler.harness`); 2 for a file that is not a valid trace (or whose
program does not fit the allocator, or whose allocator fails or exits while it is imported or built), 1 for a
recorded failure that reproduces (or fails differently), 0 otherwise. A trace whose recorded allocator is not here
(an engine library that is not installed) or that needs a CUDA device this machine lacks is skipped: it does not
raise the status. An ``--allocator`` that cannot be loaded is a usage error (2), before any replay.

A trace names the allocator its replay imports and calls: one that no :class:`~kvfuzz.registry.AllocatorTrust`
rule covers (a ``MODULE:FACTORY`` that is not registered and not kvfuzz's own) is refused with one line naming what
it would import (2), unless ``--trust-allocator`` says the traces' source is trusted; ``--allocator`` replays
against an allocator the user names instead.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Optional

from kvfuzz.commands.options import at_least_seconds, needs_torch
from kvfuzz.option_defaults import CALL_TIMEOUT
from kvfuzz.registry import AllocatorNotFound, AllocatorTrust, load_factory


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("replay", help="re-execute saved traces, without Hypothesis")
    parser.add_argument("traces", nargs="+", metavar="FILE")
    parser.add_argument("--allocator", help="replay against this allocator instead of the recorded one")
    parser.add_argument(
        "--trust-allocator",
        action="store_true",
        help="import and call the allocator a trace names even when it is not registered, a zoo: name or kvfuzz's "
        "own (only for traces from a source you trust: a trace can name any importable callable)",
    )
    parser.add_argument(
        "--call-timeout",
        type=at_least_seconds,
        default=CALL_TIMEOUT,
        metavar="SECONDS",
        help=f"an operation still running after this long is a hang (default {CALL_TIMEOUT:g}; 0: no watchdog)",
    )
    parser.set_defaults(handler=needs_torch(run_command))


# How each file ended, for the closing count, and the exit status each outcome gives.
OUTCOMES = {
    "reproduced": 1,
    "failed differently": 1,
    "no longer reproduce": 0,
    "skipped": 0,
    "could not be replayed": 2,
    "harness error": 3,  # kvfuzz's own code failed replaying a scheduler trace (kvfuzz.scheduler.harness)
}


def run_command(args: argparse.Namespace) -> int:
    if args.allocator is not None:
        try:
            load_factory(args.allocator)
        except AllocatorNotFound as error:
            print(f"kvfuzz: {error}", file=sys.stderr)
            return 2
    outcomes: Counter[str] = Counter()
    trust = AllocatorTrust(everything=args.trust_allocator)
    for path in args.traces:
        outcomes[_replay_file(path, args.allocator, args.call_timeout or None, trust)] += 1
    status = max(OUTCOMES[outcome] for outcome in outcomes)
    if len(args.traces) > 1:
        counts = ", ".join(
            f"{outcomes[outcome]} {outcome}" for outcome in OUTCOMES if outcome != "harness error" or outcomes[outcome]
        )
        print(f"{len(args.traces)} traces: {counts}; exit status {status}")
    return status


def _replay_file(path: str, allocator: Optional[str], call_timeout: Optional[float], trust: AllocatorTrust) -> str:
    """Replay one file, as its kind replays it (:mod:`kvfuzz.commands.trace_kinds`), and print what happened; returns
    its outcome (a key of :data:`OUTCOMES`)."""
    from kvfuzz.commands.trace_kinds import kind_of

    return kind_of(path).replay_file(path, allocator, call_timeout, trust)
