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
from pathlib import Path
from typing import Optional

from kvfuzz.commands.options import at_least_seconds, needs_torch
from kvfuzz.option_defaults import CALL_TIMEOUT
from kvfuzz.registry import AllocatorNotFound, AllocatorTrust, UntrustedAllocator, load_factory
from kvfuzz.saved.hint import show_hint
from kvfuzz.text import printable


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
    """Replay one file and print what happened; returns its outcome (a key of :data:`OUTCOMES`). The file's name is
    printed escaped (:func:`kvfuzz.text.printable`): a directory's names are not kvfuzz's to trust."""
    name = printable(path)
    from kvfuzz.commands.scheduler_traces import is_scheduler_trace, replay_file

    if is_scheduler_trace(path):
        if allocator is not None:
            print(
                f"kvfuzz: {name}: a scheduler trace is replayed against its scheduler, not --allocator", file=sys.stderr
            )
            return "could not be replayed"
        return replay_file(path, call_timeout)
    from kvfuzz.program.replay import NotApplicable
    from kvfuzz.saved.corpus import allocator_missing, replay_trace
    from kvfuzz.saved.trace import TraceError, TraceUnavailable
    from kvfuzz.saved.trace import load as load_trace

    try:
        trace = load_trace(Path(path))
    except TraceUnavailable as error:
        print(f"{name}: skipped: {printable(str(error).removeprefix(f'{Path(path)}: '))}\n")
        return "skipped"
    except TraceError as error:
        print(f"kvfuzz: {printable(str(error))}", file=sys.stderr)
        return "could not be replayed"
    spec = allocator or trace.allocator
    try:
        if allocator is None:
            trust.check(trace.allocator)
    except UntrustedAllocator as error:
        print(
            f"kvfuzz: {name}: {error}: replay it against an allocator you name (--allocator SPEC), or pass "
            "--trust-allocator if you trust where the trace came from",
            file=sys.stderr,
        )
        return "could not be replayed"
    try:
        load_factory(spec)
    except AllocatorNotFound as error:
        if not allocator_missing(error):  # it is here, and its import raised or exited
            print(f"kvfuzz: {name}: {error}", file=sys.stderr)
            return "could not be replayed"
        print(f"{name}: skipped: cannot load its allocator here: {error}\n")
        return "skipped"
    print(
        f"{name}: recorded against {trace.allocator}: {printable(str(trace.failure.get('title')))}"
        + (f" (known bug: {printable(trace.known_bug)})" if trace.known_bug else "")
    )
    try:
        replayed = replay_trace(
            trace,
            allocator,
            on_call=lambda index, call: print(f"  {index + 1:3}  {call}"),
            call_timeout=call_timeout,
            trust=trust,
        )
    except NotApplicable as error:
        print(f"kvfuzz: {name}: {error}", file=sys.stderr)
        return "could not be replayed"
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # building the allocator or its kernel failed (a sys.exit too): report, go on
        raised = " ".join(f"{type(error).__name__}: {error}".split())
        print(f"kvfuzz: {name}: replay could not start against {spec!r}: {raised}", file=sys.stderr)
        return "could not be replayed"
    failed_at = replayed.outcome.failed_at
    if not replayed.failed:
        print(f"  ok   replayed against {replayed.allocator}: the failure no longer reproduces\n")
        return "no longer reproduce"
    assert failed_at is not None  # replay() records where each failure happened: a call's index, or teardown
    where = "teardown" if failed_at == len(trace.program) else f"call {failed_at + 1}"
    verdict = "REPRODUCED" if replayed.reproduced else "FAILED DIFFERENTLY"
    print(
        f"  >>   {verdict} at {where} against {replayed.allocator}:\n"
        + "\n".join(f"       {line}" for line in replayed.describe_failure().splitlines())
    )
    print(f"       {show_hint(Path(path), trace.allocator)}\n")
    return "reproduced" if replayed.reproduced else "failed differently"
