"""The measuring process of benchmarks/calls.py: one allocator, one checkout of kvfuzz (the one on PYTHONPATH),
answering requests read from stdin, one JSON object a line, with one line ``CALLS-JSON {...}`` on stdout each.

Requests: ``{"phase": P, "checks": bool, "seed": n, "min_cpu": s}`` runs phase P (``random``, ``hypothesis`` or
``worker``) once with seed n, then again with seeds n + 1000, n + 2000, ... until it has taken at least s CPU seconds
(``min_cpu`` absent: once), and answers ``{"calls": n, "cpu": seconds, "rounds": n}``; ``{"profile": n}`` answers
``{"text": ...}``, cProfile's top ``n`` by cumulative and by own time over random programs; ``{"breakdown":
PACKAGE}`` answers each category's CPU seconds over random programs (:class:`Attribution`, PACKAGE being the
library's), the calls made, and the same programs' calls and CPU seconds unprofiled. Every phase runs with checks on
unless ``checks`` is false.

A call is one ``Execution.execute`` (one operation of a program, whoever drew it); CPU time is
``time.process_time()`` of this process around the phase only (its imports and the allocator's probe excluded).
The code here uses only what kvfuzz has offered since commit 6ba730b, so that a checkout of that commit can be
measured beside this one.

"Checks off" (:class:`CheckSwitch`): kvfuzz has no switch for its checks, so this process replaces, on the checker
classes, every public method annotated to return ``None`` (a check: it returns normally or raises a violation) with
one that does nothing. Checker methods that return a value the engine uses (a block table read and validated, a
cache hit's verdict, a snapshot for a later check) still run; so do the expected state, the contiguous reference,
the K/V writes, copies and the allocator. What the switch saves is therefore the checks proper, attention
(invariant 2) the largest, not the bookkeeping they rely on.

Usage (by benchmarks/calls.py): PYTHONPATH=CHECKOUT python benchmarks/calls_measure.py ALLOCATOR_SPEC
"""

from __future__ import annotations

import cProfile
import gc
import importlib
import importlib.util
import inspect
import io
import json
import multiprocessing
import pkgutil
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Mapping, Optional

RANDOM_PROGRAMS = 30
"""Random programs of one measurement (each of PROGRAM_CALLS calls)."""

PROGRAM_CALLS = 50
"""Calls of one random program, as issue 29 measured them."""

HYPOTHESIS_EXAMPLES = 15
"""Examples of one Hypothesis phase (up to PROGRAM_CALLS steps each), as ``kvfuzz run`` drives the machine after its
random programs."""

WORKER_EXAMPLES = 40
"""The example budget of one campaign worker's loop: a batch of random programs, then a Hypothesis round."""

ANSWER = "CALLS-JSON "
"""The prefix of an answer line on stdout (anything else there is the libraries' logging)."""


def _skipped(*args: object, **kwargs: object) -> None:
    """A check switched off."""


class CheckSwitch:
    """Every check method of kvfuzz's checker classes (any module under ``kvfuzz.engine`` whose name mentions
    checks), switched on or off together. ``methods`` holds the originals, to put back."""

    def __init__(self) -> None:
        import kvfuzz.engine

        self.methods: list[tuple[type, str, Callable[..., Any]]] = []  # (class, name, the original method)
        for module_info in pkgutil.walk_packages(kvfuzz.engine.__path__, "kvfuzz.engine."):
            if not any("checks" in part for part in module_info.name.split(".")):
                continue
            module = importlib.import_module(module_info.name)
            for cls in vars(module).values():
                if inspect.isclass(cls) and cls.__module__ == module.__name__:
                    for name, method in vars(cls).items():
                        annotated = getattr(method, "__annotations__", {}).get("return", "absent")
                        if not name.startswith("_") and inspect.isfunction(method) and annotated in ("None", None):
                            self.methods.append((cls, name, method))

    def set(self, on: bool) -> None:
        for cls, name, method in self.methods:
            setattr(cls, name, method if on else _skipped)


class CallCounter:
    """Counts ``Execution.execute`` calls (``count``) by wrapping the method once."""

    def __init__(self) -> None:
        from kvfuzz.program.execution import Execution

        self.count = 0  # calls executed since the counter was made
        original = Execution.execute

        def execute(execution: Execution, name: str, arguments: Mapping[str, Any]) -> None:
            self.count += 1
            original(execution, name, arguments)

        Execution.execute = execute  # type: ignore[method-assign,assignment]


class Attribution:
    """CPU time split by whose code runs, through ``sys.setprofile``: ``library`` (the engine's package), ``adapter``
    (``kvfuzz/adapters/`` and whatever it calls outside the library: torch, the standard library, kvfuzz's types),
    ``kvfuzz`` (kvfuzz's own engine, checks, program drivers, and whatever they call outside the library and the
    adapters) and ``other`` (code entered from neither: Hypothesis, the benchmark). A function outside these trees
    (torch, the standard library, a C function) counts for whoever called it. Profiling costs time at every call
    and return, which would weigh on code made of many small calls: that cost per event is measured first
    (:meth:`calibrate`) and taken off each category's events, so the figures estimate the unprofiled times."""

    def __init__(self, library: Path, kvfuzz_root: Path) -> None:
        self.library = str(library)  # the engine's package directory
        self.adapters = str(kvfuzz_root / "adapters")
        self.kvfuzz = str(kvfuzz_root)
        self.seconds = {"library": 0.0, "adapter": 0.0, "kvfuzz": 0.0, "other": 0.0}  # CPU seconds by category
        self.events = dict.fromkeys(self.seconds, 0)  # profiling events counted against each category
        self.per_event = 0.0  # the profiler's own cost per event, measured by calibrate()
        self.stack: list[str] = ["other"]  # the category of each frame being run
        self.categories: dict[str, Optional[str]] = {}  # file -> its category, None: its caller's
        self.last = 0.0

    def category(self, filename: str, caller: str) -> str:
        known = self.categories.get(filename, "unknown")
        if known == "unknown":
            if filename.startswith(self.library):
                known = "library"
            elif filename.startswith(self.adapters):
                known = "adapter"
            elif filename.startswith(self.kvfuzz):
                known = "kvfuzz"
            else:
                known = None
            self.categories[filename] = known
        if known is None or (known == "kvfuzz" and caller in ("library", "adapter")):
            return caller
        return known

    def trace(self, frame: FrameType, event: str, arg: object) -> None:
        now = time.process_time()
        self.seconds[self.stack[-1]] += now - self.last
        self.events[self.stack[-1]] += 1
        if event == "call":
            self.stack.append(self.category(frame.f_code.co_filename, self.stack[-1]))
        elif event == "c_call":
            self.stack.append(self.stack[-1])
        elif len(self.stack) > 1:  # return, c_return, c_exception
            self.stack.pop()
        self.last = time.process_time()

    def run(self, work: Callable[[], None]) -> None:
        self.last = time.process_time()
        sys.setprofile(self.trace)
        try:
            work()
        finally:
            sys.setprofile(None)

    def calibrate(self, calls: int = 20_000, runs: int = 5) -> None:
        """The time an empty function's call and return are charged under the profiler, per event: the least of
        ``runs`` measurements (other jobs on the machine only ever add to it)."""
        estimates = []
        for _ in range(runs):
            self.seconds = dict.fromkeys(self.seconds, 0.0)
            self.events = dict.fromkeys(self.seconds, 0)
            self.run(lambda: _empty_calls(calls))
            estimates.append(self.seconds["other"] / self.events["other"])
        self.per_event = min(estimates)
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.events = dict.fromkeys(self.seconds, 0)

    def estimates(self) -> dict[str, float]:
        """Each category's CPU seconds less the profiler's cost of its events."""
        return {name: max(0.0, seconds - self.per_event * self.events[name]) for name, seconds in self.seconds.items()}


def _empty() -> None:
    """Calibration: a call that does nothing."""


def _empty_calls(calls: int) -> None:
    for _ in range(calls):
        _empty()


class Measurer:
    """One allocator under one checkout: the phases, each timed on this process's CPU clock."""

    def __init__(self, spec: str) -> None:
        import torch

        from kvfuzz.registry import load_factory

        torch.set_num_threads(1)  # as kvfuzz's runs and workers do
        self.spec = spec
        self.factory = load_factory(spec)
        self.switch = CheckSwitch()
        self.counter = CallCounter()
        self.limits: Any = None  # what the allocator builds, probed before the first worker loop

    def random_programs(self, seed: int, programs: int = RANDOM_PROGRAMS) -> None:
        from kvfuzz.program.execution import Target
        from kvfuzz.program.random_programs import random_program

        target, rng = Target(self.factory), random.Random(seed)
        for _ in range(programs):
            found = random_program(target, rng, PROGRAM_CALLS)
            if found is not None:
                raise SystemExit(f"{self.spec} failed a random program: {found.failure}")

    def hypothesis(self, seed: int) -> None:
        from kvfuzz.engine.config import MachineConfig
        from kvfuzz.runner import run

        summary = run(
            self.factory,
            MachineConfig(),
            examples=HYPOTHESIS_EXAMPLES,
            steps=PROGRAM_CALLS,
            seed=seed,
            allocator_name=self.spec,
            random_examples=0,
            shrink=False,
        )
        if summary.failed:
            raise SystemExit(f"{self.spec} failed in the Hypothesis phase: {summary.explanation}")

    def worker(self, seed: int) -> None:
        """A campaign worker's search loop (``_Worker.search``), in this process, until its example budget is
        spent; its progress messages go to a queue nobody reads."""
        from kvfuzz.campaign import worker
        from kvfuzz.campaign.flag import Flag
        from kvfuzz.campaign.known import KnownFindings
        from kvfuzz.campaign.protocol import Reporter, WorkerContext
        from kvfuzz.engine.config import MachineConfig

        with tempfile.TemporaryDirectory() as scratch:
            root = Path(scratch)
            plan = worker.WorkerPlan(
                0, seed, (self.spec,), (self.limits,), MachineConfig(), root / "corpus", None, root / "state"
            )
            (root / "corpus").mkdir()
            queue: Any = multiprocessing.Queue()
            queue.cancel_join_thread()
            budget: Any = multiprocessing.Value("i", WORKER_EXAMPLES)
            stop, halt = Flag(multiprocessing.get_context()), Flag(multiprocessing.get_context())
            context = WorkerContext(
                0,
                0,
                seed,
                Reporter(queue, 0),
                stop,
                halt,
                budget,
                KnownFindings(),
                root / "state",
                root / "state" / "claims",
            )
            worker._Worker(plan, context).search()
            found = sorted(path.name for path in (root / "corpus").glob("*.json"))
            if found:
                raise SystemExit(f"{self.spec} failed in a campaign worker: {found}")

    def measure(self, phase: str, checks: bool, seed: int, min_cpu: float = 0.0) -> dict[str, float]:
        """Calls and CPU seconds of ``phase`` run with seeds ``seed``, ``seed + 1000``, ... until at least
        ``min_cpu`` CPU seconds are spent (once at least): a longer measurement averages out more of the machine's
        moments. Garbage is collected first, outside the clock, so that one measurement does not pay for another's."""
        if phase == "worker" and self.limits is None:
            from kvfuzz.campaign.swarm import probe_limits
            from kvfuzz.engine.config import MachineConfig

            self.limits = probe_limits(self.spec, self.factory, MachineConfig())
        work = {"random": self.random_programs, "hypothesis": self.hypothesis, "worker": self.worker}[phase]
        self.switch.set(checks)
        try:
            gc.collect()
            calls, started, rounds = self.counter.count, time.process_time(), 0
            while rounds == 0 or time.process_time() - started < min_cpu:
                work(seed + 1000 * rounds)
                rounds += 1
            return {"calls": self.counter.count - calls, "cpu": time.process_time() - started, "rounds": rounds}
        finally:
            self.switch.set(True)

    def profile(self, top: int) -> dict[str, str]:
        profiler = cProfile.Profile()
        profiler.runcall(self.random_programs, 0)
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).strip_dirs()
        stats.sort_stats("cumulative").print_stats(top)
        stats.sort_stats("tottime").print_stats(top)
        return {"text": text.getvalue()}

    def breakdown(self, library: str) -> dict[str, Any]:
        import kvfuzz

        spec = importlib.util.find_spec(library)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"{library} is not importable here")
        attribution = Attribution(Path(list(spec.submodule_search_locations)[0]), Path(kvfuzz.__file__).parent)
        attribution.calibrate()
        calls = self.counter.count
        attribution.run(lambda: self.random_programs(0))
        profiled = {"calls": self.counter.count - calls, "seconds": attribution.estimates()}
        return {**profiled, "unprofiled": self.measure("random", True, 0)}


def main() -> None:
    import kvfuzz

    measurer = Measurer(sys.argv[1])
    # Warm-up: every phase once, so that lazy imports and first-call costs (the runner's and Hypothesis's imports,
    # Hypothesis's first collection of garbage, the worker's probe of the allocator: about 2.5 CPU seconds, counted
    # before in the first Hypothesis-phase measurement alone) stay out of the figures.
    measurer.random_programs(1, programs=3)
    measurer.measure("hypothesis", True, 1)
    measurer.measure("worker", True, 1)
    print(
        ANSWER + json.dumps({"ready": str(Path(kvfuzz.__file__).parent), "switched": len(measurer.switch.methods)}),
        flush=True,
    )
    for line in sys.stdin:
        request = json.loads(line)
        if "phase" in request:
            answer: dict[str, Any] = measurer.measure(
                request["phase"], request["checks"], request["seed"], request.get("min_cpu", 0.0)
            )
        elif "profile" in request:
            answer = measurer.profile(request["profile"])
        else:
            answer = measurer.breakdown(request["breakdown"])
        print(ANSWER + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
