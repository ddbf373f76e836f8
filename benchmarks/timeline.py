"""How long ``kvfuzz show`` takes, and how large its page is: for the largest corpus trace that replays here, and for
a 10,000-call trace (the most a timeline shows).

For each trace, side by side in one run: a plain replay (``kvfuzz replay``'s, the floor), the replay that records
the timeline, drawing the page, and drawing the PNG (matplotlib imported beforehand, its import timed on its own).
Targets (issue 15): the page under 1 s and the PNG under 3 s, beyond the replay itself.

The 10,000-call trace is a random program over every operation (seed 0) against kvfuzz's correct allocator, so it
does not fail: the timeline draws all 10,000 calls, on the 16 most active blocks (with no failure to choose them),
which is the most work a page does. (A long program against a zoo variant fails long before its end, and a failing
trace longer than 10,000 calls is drawn as its last 10,000.)

Usage: python benchmarks/timeline.py [--calls N] [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Callable, TypeVar

from kvfuzz.engine.arguments import Snapshot
from kvfuzz.program.execution import Target
from kvfuzz.program.operations import OPERATIONS
from kvfuzz.registry import AllocatorNotFound, load_factory
from kvfuzz.saved.corpus import replay_trace
from kvfuzz.saved.trace import Trace, load
from kvfuzz.threads import single_threaded_torch
from kvfuzz.timeline.html import render_html
from kvfuzz.timeline.record import record
from kvfuzz.trace_files import is_trace_file

ROOT = Path(__file__).resolve().parent.parent
FAILURE = ROOT / "corpus" / "nocopyonwrite-exclusive-writes-b4ceae19c430.json"  # its configuration is reused
ALLOCATOR = "kvfuzz.allocator.paged:paged_allocator"


def long_trace(calls: int, seed: int = 0) -> Trace:
    """A trace of exactly ``calls`` calls: a random program over every operation against kvfuzz's correct allocator
    (see the module's docstring)."""
    short = load(FAILURE)
    rng = random.Random(seed)
    with single_threaded_torch():
        execution = Target(load_factory(ALLOCATOR), short.config).start()
        try:
            while len(execution.calls) < calls:
                state = Snapshot(execution.engine.expected)
                operation = rng.choice([op for op in OPERATIONS if op.enabled(state)])
                execution.execute(operation.name, operation.draw(state, rng))
        finally:
            execution.engine.close()
    return Trace(ALLOCATOR, short.config, execution.calls, short.failure, short.declared_window)


Result = TypeVar("Result")


def timed(action: Callable[[], Result], repeat: int) -> tuple[str, Result]:
    """The best of ``repeat`` runs, as wall-clock and CPU seconds (the CPU time is what a busy machine's other
    processes cannot inflate), and the last run's result."""
    wall, cpu = float("inf"), float("inf")
    for _ in range(max(1, repeat)):
        started, started_cpu = time.perf_counter(), time.process_time()
        result = action()
        wall = min(wall, time.perf_counter() - started)
        cpu = min(cpu, time.process_time() - started_cpu)
    return f"{wall:8.3f} s wall {cpu:8.3f} s CPU", result


def measure(name: str, trace: Trace, repeat: int) -> None:
    from kvfuzz.timeline.png import render_png

    with single_threaded_torch():  # as record() runs it, so that the two replays compare
        replay_seconds, _ = timed(lambda: replay_trace(trace, call_timeout=None), repeat)
    record_seconds, timeline = timed(lambda: record(trace, name, call_timeout=None), repeat)
    page_seconds, page = timed(lambda: render_html(timeline), repeat)
    with tempfile.TemporaryDirectory() as directory:
        png = Path(directory) / "timeline.png"
        png_seconds, _ = timed(lambda: render_png(timeline, png), repeat)
        png_bytes = png.stat().st_size
    print(f"{name}: {len(trace.program)} calls, {len(timeline.lanes)} lanes, {len(timeline.marks)} marks")
    print(f"  plain replay                   {replay_seconds}")
    print(f"  replay recording the timeline  {record_seconds}")
    print(f"  page (HTML)                    {page_seconds}  {len(page.encode()) / 1024:8.1f} KiB")
    print(f"  picture (PNG)                  {png_seconds}  {png_bytes / 1024:8.1f} KiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000, help="calls of the long trace (default 10000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measurement; the best is shown")
    args = parser.parse_args()
    started, started_cpu = time.perf_counter(), time.process_time()
    import matplotlib.pyplot  # noqa: F401 -- timed apart: kvfuzz show --png pays it once

    print(
        f"matplotlib import: {time.perf_counter() - started:.3f} s wall {time.process_time() - started_cpu:.3f} s CPU"
    )
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    traces = []
    for path in sorted(ROOT.glob("corpus/*.json")):
        if not is_trace_file(path):
            continue
        trace = load(path)
        try:
            load_factory(trace.allocator)
        except AllocatorNotFound:
            continue
        traces.append((len(trace.program), path.name, trace))
    _, name, largest = max(traces, key=lambda entry: entry[:2])
    measure(f"largest corpus trace here ({name})", largest, args.repeat)
    started = time.perf_counter()
    trace = long_trace(args.calls)
    print(f"(built the {args.calls}-call trace in {time.perf_counter() - started:.1f} s)")
    measure(f"{args.calls}-call trace", trace, args.repeat)


if __name__ == "__main__":
    main()
