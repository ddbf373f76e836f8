"""Checked calls per CPU-second: random programs, the Hypothesis phase and a campaign worker's loop, each with every
check on and with the checks off (the ceiling), on kvfuzz's allocator and on the real adapters importable here.

A call is one operation of a program; CPU seconds are ``time.process_time()`` of the process that runs the phase, so
other jobs on the machine matter less than they do to wall time (they still share its caches and memory bandwidth:
prefer the ratios, measured side by side in one run). Each allocator is measured in its own process
(benchmarks/calls_measure.py, which says what "checks off" still does), one per checkout: ``--baseline PATH``
measures another checkout of kvfuzz (a worktree of an older commit, say) in the same run, its measurements
interleaved with this checkout's (ABBA: which checkout goes first alternates between repeats, so that a drift of the
machine weighs on both alike), and prints the ratio of each figure to the baseline's: the median of the repeats'
ratios, and their least and greatest (the spread: a ratio is only as sure as it).

The phases: 30 random programs of 50 calls (``kvfuzz.program.random_programs.random_program``); ``kvfuzz run``'s
Hypothesis phase, 15 examples of up to 50 steps, no shrinking; a campaign worker's search loop (random batches,
then a Hypothesis round) until its budget of 40 examples is spent. One measurement runs its phase again, with other
seeds (the same for both checkouts), until it has taken ``--min-cpu`` CPU seconds (default 2): a phase run once is
a fraction of a second, at the mercy of one moment of the machine. Each figure is the median of ``--repeats``.

``--profile`` prints instead cProfile's top ten (by cumulative and by own time) over the random programs;
``--breakdown`` prints instead, for vLLM v1 and SGLang (where importable), the CPU time per call inside the
library, inside kvfuzz's adapter and inside kvfuzz itself (benchmarks/calls_measure.py's ``Attribution``).

Usage: python benchmarks/calls.py [--repeats N] [--min-cpu SECONDS] [--baseline PATH] [--allocators NAME,NAME]
                                  [--profile | --breakdown] [--json FILE]
(run it with each engine's environment's Python to include that engine: /path/to/venv-vllm/bin/python ...)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

ALLOCATORS = {
    "kvfuzz": "kvfuzz.allocator.paged:paged_allocator",
    "vllm-v1": "kvfuzz.adapters.vllm_v1:kv_cache_manager",
    "sglang": "kvfuzz.adapters.sglang:radix_cache",
}
"""The allocators this benchmark knows, by short name."""

LIBRARIES = {"vllm-v1": "vllm", "sglang": "sglang"}
"""The package of each real adapter's engine: its code is the library time of ``--breakdown``."""

PHASES = {"random": "random programs", "hypothesis": "Hypothesis phase", "worker": "campaign worker"}

HERE = Path(__file__).resolve().parent
MEASURE = HERE / "calls_measure.py"
ANSWER = "CALLS-JSON "  # calls_measure.py's answer lines


class Measuring:
    """One measuring process: ``spec`` under the checkout at ``checkout``; ``where`` is the kvfuzz package it
    imported (so a stray installed copy cannot pass for the checkout)."""

    def __init__(self, checkout: Path, spec: str, scratch: str) -> None:
        self.name = f"{spec} under {checkout}"
        environment = dict(os.environ, PYTHONPATH=str(checkout))
        self.process = subprocess.Popen(
            [sys.executable, str(MEASURE), spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=environment,
            cwd=scratch,
        )
        self.where = ""  # the kvfuzz package the process imported
        self.switched = 0  # the check methods "checks off" replaces there

    def ready(self) -> None:
        ready = self.read()
        self.where, self.switched = ready["ready"], ready["switched"]

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self.read()

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(ANSWER):
                answer: dict[str, Any] = json.loads(line[len(ANSWER) :])
                return answer
        raise SystemExit(f"the measuring process for {self.name} ended (exit status {self.process.wait()})")

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait()


def importable(name: str) -> bool:
    library = LIBRARIES.get(name)
    return library is None or importlib.util.find_spec(library) is not None


class Parser(argparse.ArgumentParser):
    """Bad input is one line on stderr and exit status 2, before any measurement."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse() -> argparse.Namespace:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="measurements per figure; the median is printed")
    parser.add_argument(
        "--min-cpu", type=float, default=2.0, help="CPU seconds one measurement runs for at least (default 2)"
    )
    parser.add_argument("--baseline", type=Path, help="another checkout of kvfuzz, measured in the same run")
    parser.add_argument(
        "--allocators", help=f"of {', '.join(ALLOCATORS)} (default: kvfuzz and the adapters importable here)"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--profile", action="store_true", help="cProfile's top ten over random programs instead")
    mode.add_argument("--breakdown", action="store_true", help="library / adapter / kvfuzz time per call instead")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, not {args.repeats}")
    if not args.min_cpu >= 0:
        parser.error(f"--min-cpu must be a number of seconds, at least 0, not {args.min_cpu}")
    if args.baseline is not None and not (args.baseline / "kvfuzz" / "__init__.py").is_file():
        parser.error(f"--baseline {args.baseline} is not a checkout of kvfuzz (no kvfuzz/__init__.py there)")
    names = args.allocators.split(",") if args.allocators else [name for name in ALLOCATORS if importable(name)]
    if args.breakdown and not args.allocators:
        names = [name for name in names if name in LIBRARIES]
    unknown = [name for name in names if name not in ALLOCATORS]
    if unknown:
        parser.error(f"--allocators: unknown {', '.join(unknown)} (known: {', '.join(ALLOCATORS)})")
    missing = [name for name in names if not importable(name)]
    if missing:
        parser.error(f"--allocators: {', '.join(missing)} not importable with {sys.executable}")
    if args.breakdown and any(name not in LIBRARIES for name in names):
        parser.error(f"--breakdown is for the real adapters ({', '.join(LIBRARIES)})")
    if not names:
        parser.error(f"--breakdown: none of {', '.join(LIBRARIES)} is importable with {sys.executable}")
    args.names = names
    return args


def measure(args: argparse.Namespace, checkouts: dict[str, Path], scratch: str) -> dict[str, Any]:
    """Every figure asked for, per allocator, per checkout: the processes of one allocator run side by side, and
    their measurements alternate."""
    figures: dict[str, Any] = {}
    for name in args.names:
        processes = {tree: Measuring(path, ALLOCATORS[name], scratch) for tree, path in checkouts.items()}
        for process in processes.values():
            process.ready()
        figures[name] = {
            tree: {"kvfuzz": process.where, "switched": process.switched} for tree, process in processes.items()
        }
        for repeat in range(args.repeats if not args.profile else 1):
            for tree, process in processes.items():
                found = figures[name][tree]
                if args.profile:
                    found["profile"] = process.ask({"profile": 10})["text"]
                elif args.breakdown:
                    found.setdefault("breakdown", []).append(process.ask({"breakdown": LIBRARIES[name]}))
            if args.profile or args.breakdown:
                continue
            order = list(processes.items()) if repeat % 2 == 0 else list(processes.items())[::-1]
            for phase in PHASES:
                for checks in (True, False):
                    for tree, process in order:
                        request = {"phase": phase, "checks": checks, "seed": repeat, "min_cpu": args.min_cpu}
                        answer = process.ask(request)
                        key = f"{phase} {'on' if checks else 'off'}"
                        figures[name][tree].setdefault(key, []).append(answer["calls"] / answer["cpu"])
        for process in processes.values():
            process.close()
    return figures


def ratios(mine: list[float], theirs: list[float]) -> str:
    """The median of the repeats' ratios, and their spread (least-greatest)."""
    each = [a / b for a, b in zip(mine, theirs)]
    return f"{statistics.median(each):5.2f} [{min(each):.2f}-{max(each):.2f}]"


def print_rates(figures: dict[str, Any], baseline: bool, repeats: int) -> None:
    print(f"checked calls per CPU-second, median of {repeats} (checks off: the ceiling, see calls_measure.py)")
    header = f"{'allocator':<9} {'phase':<17} {'checks on':>10} {'off':>8} {'on/off':>7}"
    if baseline:
        header += f" | {'baseline on':>11} {'off':>8} | {'x on [spread]':>17} {'x off [spread]':>17}"
    print(header)
    for name, trees in figures.items():
        for phase, label in PHASES.items():
            on, off = trees["current"][f"{phase} on"], trees["current"][f"{phase} off"]
            line = f"{name:<9} {label:<17} {statistics.median(on):10.0f} {statistics.median(off):8.0f}"
            line += f" {statistics.median(on) / statistics.median(off):7.2f}"
            if baseline:
                base_on, base_off = trees["baseline"][f"{phase} on"], trees["baseline"][f"{phase} off"]
                line += f" | {statistics.median(base_on):11.0f} {statistics.median(base_off):8.0f}"
                line += f" | {ratios(on, base_on):>17} {ratios(off, base_off):>17}"
            print(line)
    if baseline:
        print("x on / x off: this checkout's figure over the baseline's: median of repeats' ratios [least-greatest]")


def print_breakdown(figures: dict[str, Any]) -> None:
    print("CPU microseconds per call of 50-call random programs, every check on, under a profiler (sys.setprofile),")
    print("least of the repeats (others' jobs only add); library: the engine's code; adapter: kvfuzz/adapters and")
    print("what it calls outside the library;", end=" ")
    print("kvfuzz: kvfuzz's engine model and checks; other: Hypothesis and the benchmark's driver;")
    print("and the same programs' CPU time per call unprofiled (the profiler's own cost is estimated and taken off)")
    print(
        f"{'allocator':<9} {'checkout':<9} {'library':>8} {'adapter':>8} {'kvfuzz':>8} {'other':>7}"
        f" {'adapter share':>13} {'unprofiled':>10}"
    )
    for name, trees in figures.items():
        for tree, found in trees.items():
            per_call = {
                category: min(run["seconds"][category] / run["calls"] for run in found["breakdown"])
                for category in ("library", "adapter", "kvfuzz", "other")
            }
            found["per_call"] = per_call
            micro = {category: 1e6 * seconds for category, seconds in per_call.items()}
            share = per_call["adapter"] / sum(per_call.values())
            unprofiled = min(run["unprofiled"]["cpu"] / run["unprofiled"]["calls"] for run in found["breakdown"])
            print(
                f"{name:<9} {tree:<9} {micro['library']:8.1f} {micro['adapter']:8.1f} {micro['kvfuzz']:8.1f}"
                f" {micro['other']:7.1f} {100 * share:12.1f}% {1e6 * unprofiled:10.1f}"
            )


def main() -> None:
    args = parse()
    checkouts: dict[str, Path] = {"current": HERE.parent}
    if args.baseline is not None:
        checkouts["baseline"] = args.baseline.resolve()
    with tempfile.TemporaryDirectory() as scratch:
        figures = measure(args, checkouts, scratch)
    for name, trees in figures.items():
        for tree, found in trees.items():
            print(f"{name} ({tree}): kvfuzz from {found['kvfuzz']}, {found['switched']} check methods switchable")
    if args.profile:
        for name, trees in figures.items():
            for tree, found in trees.items():
                print(f"\n== {name}, {tree}: cProfile of random programs, every check on ==\n{found['profile']}")
    elif args.breakdown:
        print_breakdown(figures)
    else:
        print_rates(figures, args.baseline is not None, args.repeats)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
