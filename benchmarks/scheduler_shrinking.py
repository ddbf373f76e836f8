"""How far, and how fast, a scheduler failure shrinks by deleting operations (kvfuzz/scheduler/shrinking.py):
for each scheduler trace given, its replay's signature, then the shrink a campaign runs for a mutant's failure or
one whose shrinking by Hypothesis drifted (every candidate replayed against the installed engine, kept only under
that signature), within ``--seconds``: operations before and after, replays, seconds. ``--pad`` first adds
operations the failure does not need (a step before the program; two steps, a one-token request and a step after),
to measure how well the pass finds a trace's own program again. Runs in the engine's environment, from the
repository root.

Usage: PYTHONPATH=$PWD python benchmarks/scheduler_shrinking.py TRACE... [--seconds S] [--pad]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import attrs

from kvfuzz.scheduler.program import AddRequest, Step
from kvfuzz.scheduler.replay import bounded_replay
from kvfuzz.scheduler.shrinking import shrink_trace
from kvfuzz.scheduler.signature import scheduler_signature
from kvfuzz.scheduler.trace import SchedulerTraceError, load

CALL_TIMEOUT = 60.0
"""Seconds a replayed step may take before it is a hang, as a campaign's default watchdog."""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--seconds", type=float, default=60.0, help="each shrink's time bound (default 60)")
    parser.add_argument("--pad", action="store_true", help="add operations the failure does not need first")
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        print("scheduler_shrinking.py: --seconds must be positive", file=sys.stderr)
        return 2
    try:
        traces = [(path, load(path)) for path in args.traces]
    except (OSError, SchedulerTraceError) as error:
        print(f"scheduler_shrinking.py: {error}", file=sys.stderr)
        return 2
    print(f"{'trace':<56} {'before':>6} {'after':>5} {'replays':>7} {'seconds':>7}  signature")
    for path, trace in traces:
        if args.pad:
            trace = attrs.evolve(trace, program=(Step(), *trace.program, Step(), Step(), AddRequest([1], 1), Step()))
        found = bounded_replay(trace, CALL_TIMEOUT)
        if found.error is None:
            print(f"{path.name:<56} {len(trace.program):>6}  does not fail here: {found.describe_failure()}")
            continue
        signature = scheduler_signature(trace.scheduler, found.error)
        started = time.perf_counter()
        shrunk = shrink_trace(
            trace, signature, lambda candidate: bounded_replay(candidate, CALL_TIMEOUT), seconds=args.seconds
        )
        seconds = time.perf_counter() - started
        stopped = " (time bound)" if shrunk.stopped else ""
        print(
            f"{path.name:<56} {len(trace.program):>6} {len(shrunk.trace.program):>5} {shrunk.replays:>7} "
            f"{seconds:>7.1f}  {signature}{stopped}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
