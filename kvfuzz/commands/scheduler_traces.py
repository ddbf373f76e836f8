"""``kvfuzz replay``, ``show`` and ``export`` of a scheduler target's trace (``kvfuzz-scheduler-trace/1``,
:mod:`kvfuzz.scheduler.trace`): each command hands a file of that kind here, by its bytes
(:func:`kvfuzz.saved.files.json_file_kind`), and keeps allocator traces to itself.

A file that is not a valid scheduler trace is one line and exit status 2, before any work, as is a replay where vLLM
refuses the trace's configuration. Replay's outcomes are allocator replay's: ``reproduced`` and ``failed
differently`` (1), ``no longer reproduce`` and ``skipped`` (0: vLLM is not installed here, as a trace whose
allocator is not installed is skipped), ``could not be replayed`` (2)."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from kvfuzz.saved.files import json_file_kind
from kvfuzz.text import printable, printable_lines

if TYPE_CHECKING:
    from kvfuzz.scheduler.trace import SchedulerTrace


def is_scheduler_trace(path: str) -> bool:
    """Whether ``path`` is a ``.json`` file whose bytes name the scheduler trace format."""
    return json_file_kind(Path(path)) == "scheduler-trace"


def _load(path: str) -> Optional[SchedulerTrace]:
    """The trace, or None after one line on standard error."""
    from kvfuzz.scheduler.trace import SchedulerTraceError, load

    try:
        return load(Path(path))
    except SchedulerTraceError as error:
        print(f"kvfuzz: {printable(str(error))}", file=sys.stderr)
        return None


def replay_file(path: str, call_timeout: Optional[float] = None) -> str:
    """Replay one scheduler trace and print what happened; returns its outcome (a key of
    :data:`kvfuzz.commands.replay.OUTCOMES`); a step running past ``call_timeout`` seconds fails the hang check (None:
    no watchdog)."""
    from kvfuzz.program.safeguards import Watchdog
    from kvfuzz.scheduler.harness import HarnessError
    from kvfuzz.scheduler.recorder import vllm_version
    from kvfuzz.scheduler.replay import ReplayRefused, missing_vllm, replay
    from kvfuzz.scheduler.replay_result import RunnerUnavailable
    from kvfuzz.scheduler.sglang.build import sglang_missing
    from kvfuzz.scheduler.sglang.traces import missing_sglang, sglang_version
    from kvfuzz.scheduler.trace import SGLANG
    from kvfuzz.scheduler.vllm_build import vllm_missing

    name = printable(path)
    trace = _load(path)
    if trace is None:
        return "could not be replayed"
    sglang = trace.scheduler == SGLANG
    if sglang_missing() if sglang else vllm_missing():  # as a trace whose allocator is not installed: skipped
        print(f"{name}: skipped: {missing_sglang(trace) if sglang else missing_vllm(trace)}\n")
        return "skipped"
    known = f" (known bug: {printable(trace.known_bug)})" if trace.known_bug else ""
    print(f"{name}: recorded against {trace.scheduler}: {printable(trace.failure.check)}{known}")
    print(f"  {trace.setup.describe()}; {trace.engine_description()}")
    here = sglang_version() if sglang else vllm_version()
    if here != trace.vllm_version and here != "unknown":
        print(f"  note: recorded with {trace.engine_name} {trace.vllm_version}, replayed with {here}")
    try:
        with Watchdog(call_timeout) if call_timeout else contextlib.nullcontext() as watchdog:
            replayed = replay(
                trace,
                on_operation=lambda index, operation: print(f"  {index + 1:3}  {operation}"),
                watchdog=watchdog,
            )
    except RunnerUnavailable as error:  # as a trace whose engine is not installed here: skipped
        print(f"{name}: skipped: {error}\n")
        return "skipped"
    except ReplayRefused as error:
        print(f"kvfuzz: {name}: {error}", file=sys.stderr)
        return "could not be replayed"
    except HarnessError as error:
        print(f"{name}: not replayed to its end:\n{error.describe()}", file=sys.stderr)
        return "harness error"
    if not replayed.failed:
        print("  ok   every check passed, the drain included: the failure no longer reproduces\n")
        return "no longer reproduce"
    verdict = "REPRODUCED" if replayed.reproduced else "FAILED DIFFERENTLY"
    same = " (the recorded message, word for word)" if replayed.identical else ""
    print(f"  >>   {verdict} at {replayed.where()}{same}:")
    print("\n".join(f"       {line}" for line in replayed.describe_failure().splitlines()))
    if not replayed.reproduced:
        print(f"       recorded: {printable_lines(trace.failure.describe())}")
    print(f"       see it with: kvfuzz show {name}\n")
    return "reproduced" if replayed.reproduced else "failed differently"


def show(path: str, html: Optional[str], png: Optional[str], allocator: Optional[str]) -> int:
    """``kvfuzz show`` of a scheduler trace: its configuration, program and failure as text; then, where its engine
    is installed, its replay drawn as a timeline of requests over steps (an HTML page, and a PNG with ``--png``).
    Where the engine is missing the text is all (exit 0), unless a page or picture was asked for (one line, exit 2)."""
    from kvfuzz.commands.output_files import OutputNotWritten, check_outputs, write_text, written_atomically
    from kvfuzz.saved.hint import default_page

    if allocator is not None:
        print(f"kvfuzz: {path}: a scheduler trace is replayed against its scheduler, not --allocator", file=sys.stderr)
        return 2
    trace = _load(path)
    if trace is None:
        return 2
    page = Path(html) if html else default_page(Path(path))
    try:
        check_outputs({"--html": str(page), "--png": png}, {"TRACE": path})
    except ValueError as error:
        print(f"kvfuzz: {error}", file=sys.stderr)
        return 2
    missing = missing_engine(trace)
    if missing is not None and (html is not None or png is not None):
        flag = "--html" if html is not None else "--png"
        print(f"kvfuzz: {flag}: drawing the timeline replays the trace, and {missing}", file=sys.stderr)
        return 2
    if png is not None:
        try:
            import matplotlib  # noqa: F401 -- only whether the plot extra is installed
        except ImportError:
            print("kvfuzz: --png needs matplotlib: pip install 'kvfuzz[plot]'", file=sys.stderr)
            return 2
    name = printable(path)  # a file name that is not UTF-8 prints (and goes into the page) escaped
    print(printable_lines("\n".join(trace.describe())))
    if missing is not None:
        print(f"\nno timeline: {missing}")
        print(f"replay it with: kvfuzz replay {name}")
        return 0
    from kvfuzz.scheduler.replay_result import ReplayRefused
    from kvfuzz.timeline.requests import record_requests
    from kvfuzz.timeline.requests_html import render_requests_html

    started = time.perf_counter()
    try:
        timeline = record_requests(trace, name)
    except ReplayRefused as error:
        print(f"kvfuzz: {name}: {error}", file=sys.stderr)
        return 2
    try:
        write_text(page, render_requests_html(timeline))
        if png is not None:
            from kvfuzz.timeline.requests_png import render_requests_png

            with written_atomically(Path(png)) as picture:
                render_requests_png(timeline, picture)
    except OutputNotWritten as error:
        print(f"kvfuzz: {error}", file=sys.stderr)
        return 2
    where = f" at step {timeline.failing_step}" if timeline.failing_step is not None else ""
    about = f", request {timeline.failing_request}" if timeline.failing_request is not None else ""
    print(f"\nreplayed: {timeline.verdict}{where}{about} ({timeline.total_steps} steps)")
    pictures = f" and {printable(png)}" if png else ""
    print(f"timeline: {printable(str(page))}{pictures} ({time.perf_counter() - started:.2f} s)")
    return 0


def missing_engine(trace: SchedulerTrace) -> Optional[str]:
    """Why the trace's engine cannot replay it here (None: it is installed)."""
    from kvfuzz.scheduler.replay import missing_vllm
    from kvfuzz.scheduler.sglang.build import sglang_missing
    from kvfuzz.scheduler.sglang.traces import missing_sglang
    from kvfuzz.scheduler.trace import SGLANG
    from kvfuzz.scheduler.vllm_build import vllm_missing

    if trace.scheduler == SGLANG:
        return missing_sglang(trace) if sglang_missing() else None
    return missing_vllm(trace) if vllm_missing() else None


def export(path: str, output: Optional[str], allocator: Optional[str]) -> int:
    """``kvfuzz export`` of a scheduler trace: a pytest file replaying it."""
    from kvfuzz.commands.output_files import write_or_print
    from kvfuzz.scheduler.export import export_test

    if allocator is not None:
        print(f"kvfuzz: {path}: a scheduler trace takes no --allocator", file=sys.stderr)
        return 2
    trace = _load(path)
    if trace is None:
        return 2
    return write_or_print(export_test(trace, path), output, "pytest {path} (in vLLM's environment)")
