"""``kvfuzz replay``, ``show`` and ``export`` of a scheduler target's trace (``kvfuzz-scheduler-trace/1``,
:mod:`kvfuzz.scheduler.trace`): the scheduler targets' side of the trace commands (:mod:`kvfuzz.commands.trace_kinds`),
which hand a file of that kind here, by its bytes (:func:`kvfuzz.trace_files.json_file_kind`).

A file that is not a valid scheduler trace is one line and exit status 2, before any work, as is a replay where vLLM
refuses the trace's configuration. Replay's outcomes are allocator replay's: ``reproduced`` and ``failed
differently`` (1), ``no longer reproduce`` and ``skipped`` (0: vLLM is not installed here, as a trace whose
allocator is not installed is skipped), ``could not be replayed`` (2)."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from kvfuzz.commands.report_text import fenced, paragraph
from kvfuzz.registry import AllocatorTrust
from kvfuzz.text import printable, printable_lines

if TYPE_CHECKING:
    from kvfuzz.scheduler.trace import SchedulerTrace


def _load(path: str) -> Optional[SchedulerTrace]:
    """The trace, or None after one line on standard error."""
    from kvfuzz.scheduler.trace import SchedulerTraceError, load

    try:
        return load(Path(path))
    except SchedulerTraceError as error:
        print(f"kvfuzz: {printable(str(error))}", file=sys.stderr)
        return None


def replay_file(
    path: str, allocator: Optional[str], call_timeout: Optional[float] = None, trust: Optional[AllocatorTrust] = None
) -> str:
    """Replay one scheduler trace and print what happened; returns its outcome (a key of
    :data:`kvfuzz.commands.replay.OUTCOMES`); a step running past ``call_timeout`` seconds fails the hang check (None:
    no watchdog). A scheduler trace is replayed against its scheduler: an ``allocator`` is refused, and there is no
    allocator to trust."""
    if allocator is not None:
        print(
            f"kvfuzz: {printable(path)}: a scheduler trace is replayed against its scheduler, not --allocator",
            file=sys.stderr,
        )
        return "could not be replayed"
    from kvfuzz.program.safeguards import Watchdog
    from kvfuzz.scheduler.harness import HarnessError
    from kvfuzz.scheduler.recorder import vllm_version
    from kvfuzz.scheduler.replay import ReplayRefused, replay
    from kvfuzz.scheduler.replay_result import RunnerUnavailable
    from kvfuzz.scheduler.sglang.traces import sglang_version
    from kvfuzz.scheduler.trace import SGLANG

    name = printable(path)
    trace = _load(path)
    if trace is None:
        return "could not be replayed"
    missing = missing_engine(trace)
    if missing is not None:  # as a trace whose allocator is not installed: skipped
        print(f"{name}: skipped: {missing}\n")
        return "skipped"
    known = f" (known bug: {printable(trace.known_bug)})" if trace.known_bug else ""
    print(f"{name}: recorded against {trace.scheduler}: {printable(trace.failure.check)}{known}")
    print(f"  {trace.setup.describe()}; {trace.engine_description()}")
    here = sglang_version() if trace.scheduler == SGLANG else vllm_version()
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


def show(args: argparse.Namespace) -> int:
    """``kvfuzz show`` of a scheduler trace: its configuration, program and failure as text; then, where its engine
    is installed, its replay drawn as a timeline of requests over steps (an HTML page, and a PNG with ``--png``).
    Where the engine is missing the text is all (exit 0), unless a page or picture was asked for (one line, exit 2)."""
    path, html, png, allocator = args.trace, args.html, args.png, args.allocator
    from kvfuzz.commands.output_files import OutputNotWritten, check_outputs, write_text, written_atomically
    from kvfuzz.trace_saving import default_page

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


def export(args: argparse.Namespace) -> int:
    """``kvfuzz export`` of a scheduler trace: a pytest file replaying it."""
    path, output, allocator = args.trace, args.output, args.allocator
    from kvfuzz.commands.output_files import write_or_print
    from kvfuzz.scheduler.export import export_test

    if allocator is not None:
        print(f"kvfuzz: {path}: a scheduler trace takes no --allocator", file=sys.stderr)
        return 2
    trace = _load(path)
    if trace is None:
        return 2
    return write_or_print(export_test(trace, path), output, "pytest {path} (in vLLM's environment)")


def report(path: str) -> tuple[str, Optional[str]]:
    """``kvfuzz report`` of a scheduler trace: the report's text, and its reproducer's source (None where none is
    generated); raises :class:`~kvfuzz.scheduler.trace.SchedulerTraceError` for a file that is not a valid one."""
    from kvfuzz.scheduler.trace import load

    return scheduler_report(load(Path(path)), path)


def run_command_line(trace: SchedulerTrace) -> str:
    """The ``kvfuzz run`` command line that searches the trace's configuration."""
    setup = trace.setup
    flags = [f"--scheduler {trace.scheduler}", f"--num-blocks {setup.num_blocks}", f"--block-size {setup.block_size}"]
    flags += [f"--max-num-batched-tokens {setup.max_num_batched_tokens}", f"--max-num-seqs {setup.max_num_seqs}"]
    optional = {
        "--no-prefix-caching": not setup.prefix_caching,
        f"--policy {setup.policy}": setup.policy != "fcfs",
        f"--model {setup.model}": setup.model != "full",
        f"--speculative-tokens {setup.speculative_tokens}": bool(setup.speculative_tokens),
        "--async-scheduling": setup.async_scheduling,
        f"--kv-connector {setup.kv_connector}": setup.kv_connector != "none",
        f"--transfer-delay {setup.transfer_delay}": bool(setup.transfer_delay),
        "--load-failures": setup.load_failures,
        f"--load-failure-policy {setup.load_failure_policy}": setup.load_failure_policy != "recompute",
        "--skip-prefix-reads": setup.skip_prefix_reads,
        f"--retention {setup.retention}": setup.retention != "semantic",
        "--cache-salts": setup.cache_salts,
        "--stop-tokens": setup.stop_tokens,
        "--eos": setup.eos,
        "--min-tokens": setup.min_tokens,
        f"--max-loras {setup.max_loras}": bool(setup.max_loras),
        f"--long-prefill-token-threshold {setup.long_prefill_token_threshold}": bool(
            setup.long_prefill_token_threshold
        ),
        "--long-prefill-token-threshold-adaptive": setup.long_prefill_token_threshold_adaptive,
        f"--max-num-active-seqs {setup.max_num_active_seqs}": bool(setup.max_num_active_seqs),
        f"--prefill-schedule-interval {setup.prefill_schedule_interval}": setup.prefill_schedule_interval > 1,
        "--pauses": setup.pauses,
        "--no-chunked-prefill": not setup.chunked_prefill,
        "--mamba-checkpoints": setup.mamba_checkpoints,
        f"--write-path {trace.write_path}": trace.write_path != "kvfuzz",
        f"--attention {trace.attention}": trace.attention != "off",
    }
    flags += [flag for flag, on in optional.items() if on]
    return "kvfuzz run " + " ".join(flags)


def _replayed(trace: SchedulerTrace, source: str) -> tuple[str, str]:
    """The timeline section's text and the replay's verdict line, replaying the trace where its engine is here."""
    missing = missing_engine(trace)
    if missing is not None:
        return (
            f"Not drawn: {missing}. In the engine's environment, `kvfuzz show {source} --png OUT.png` draws it.",
            f"not replayed here: {missing}",
        )
    from kvfuzz.scheduler.engines import installed_version
    from kvfuzz.scheduler.replay_result import ReplayRefused
    from kvfuzz.scheduler.trace import SGLANG
    from kvfuzz.timeline.requests import record_requests
    from kvfuzz.timeline.requests_text import render_requests_text

    here = f"{trace.engine_name} {installed_version('sglang' if trace.scheduler == SGLANG else 'vllm')}"
    try:
        timeline = record_requests(trace, source)
    except ReplayRefused as error:
        return f"Not drawn: {error}.", f"{here}: could not be replayed: {error}"
    picture = (
        "A lane per request, a column per engine step (`schedule()` call), each cell the request's state after that "
        f"step's scheduling. `kvfuzz show {source} --png OUT.png` draws the same as a picture, with each step's blocks."
    )
    return f"{picture}\n\n{fenced(render_requests_text(timeline))}", f"{here}: {timeline.verdict}"


VLLM_HOW = (
    "It builds the scheduler offline from the engine's own config objects, plays the program and the model runner's "
    "outputs, and asserts the failure on the engine's own state (block reference counts and the free count, requests "
    "left unfinished past a bound, or a step's output scheduling tokens for a request it does not bring)."
)
"""What a vLLM scheduler reproducer does, in the report's words (SGLang's: ``sglang_scheduler.HOW``)."""


def scheduler_report(trace: SchedulerTrace, source: str) -> tuple[str, Optional[str]]:
    """The report of a scheduler trace, and its reproducer's source (None where none is generated)."""
    from kvfuzz.reproducers import NotReproducible, scheduler_reproducer_source, sglang_scheduler
    from kvfuzz.scheduler.trace import SGLANG

    try:
        reproducer: Optional[str] = scheduler_reproducer_source(trace, source)
        refusal = ""
    except NotReproducible as error:
        reproducer, refusal = None, str(error)
    timeline, verdict = _replayed(trace, source)
    title = trace.failure.describe().split(":")[0][:120]
    program = "\n".join(f"{index + 1:3}  {operation}" for index, operation in enumerate(trace.program))
    sections = [
        f"# {trace.engine_name} {trace.vllm_version}: {paragraph(title)}",
        "",
        f"- Engine: {trace.engine_description()}, the `{trace.scheduler}` scheduler target (the engine's own "
        "scheduler and KV-cache manager; kvfuzz plays the client and the model runner)",
        f"- Found by kvfuzz {trace.kvfuzz_version}; the command that searches this configuration: "
        f"`{run_command_line(trace)}`",
        f"- Replay it: `kvfuzz replay {source}`; export it as a pytest file (needs kvfuzz): `kvfuzz export {source}`",
        "",
        "## Configuration",
        "",
        paragraph(trace.setup.describe()) + ".",
        "",
        "## Shrunk program" if trace.shrunk else "## Program (as first found, not shrunk)",
        "",
        "The client's operations, then the drain (steps until every request finished):",
        "",
        fenced(program),
        "",
        "## What happened",
        "",
        fenced(trace.failure.describe()),
        "",
        paragraph(trace.known_bug) if trace.known_bug else "No explanation recorded beyond the failure.",
        "",
        "## Timeline",
        "",
        timeline,
        "",
        "## Versions",
        "",
        f"- Recorded on {trace.engine_name} {trace.vllm_version}.",
        f"- Replayed while writing this report: {verdict}.",
        "- The tested versions it reproduces on are in kvfuzz's docs/findings.md.",
        "",
        "## Standalone reproducer",
        "",
    ]
    if reproducer is None:
        sections += [f"None generated: {paragraph(refusal)}.", ""]
    else:
        how = sglang_scheduler.HOW if trace.scheduler == SGLANG else VLLM_HOW
        sections += [
            f"It imports only {trace.engine_name}, torch and the standard library; run it in the engine's environment "
            "with `python FILE` (exit status 1 while the failure reproduces, 0 once it is fixed) or `pytest FILE`. "
            + how,
            "",
            fenced(reproducer, "python"),
            "",
        ]
    return "\n".join(sections), reproducer
