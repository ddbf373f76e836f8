"""``kvfuzz replay``: re-execute saved traces, call by call, without Hypothesis."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvfuzz.corpus import replay_trace
from kvfuzz.program.replay import NotApplicable
from kvfuzz.registry import AllocatorNotFound
from kvfuzz.trace import TraceError
from kvfuzz.trace import load as load_trace


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("replay", help="re-execute saved traces, without Hypothesis")
    parser.add_argument("traces", nargs="+", metavar="FILE")
    parser.add_argument("--allocator", help="replay against this allocator instead of the recorded one")
    parser.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    worst = 0
    for path in args.traces:
        try:
            trace = load_trace(Path(path))
            print(
                f"{path}: recorded against {trace.allocator}: {trace.failure.get('title')}"
                + (f" (known bug: {trace.known_bug})" if trace.known_bug else "")
            )
            replayed = replay_trace(
                trace, args.allocator, on_call=lambda index, call: print(f"  {index + 1:3}  {call}")
            )
        except (TraceError, AllocatorNotFound, NotApplicable) as error:
            print(f"kvfuzz: {error}", file=sys.stderr)
            worst = max(worst, 2)
            continue
        failed_at = replayed.outcome.failed_at
        if not replayed.failed:
            print(f"  ok   replayed against {replayed.allocator}: the failure no longer reproduces\n")
            continue
        assert failed_at is not None  # replay() records where each failure happened: a call's index, or teardown
        where = "teardown" if failed_at == len(trace.program) else f"call {failed_at + 1}"
        verdict = "REPRODUCED" if replayed.reproduced else "FAILED DIFFERENTLY"
        print(
            f"  >>   {verdict} at {where} against {replayed.allocator}:\n"
            + "\n".join(f"       {line}" for line in replayed.describe_failure().splitlines())
            + "\n"
        )
        worst = max(worst, 1)
    return worst
