"""``kvfuzz report TRACE``: what an engine maintainer needs to act on a failure, in one Markdown file: the engine and
its version, kvfuzz's version and the command that searches that configuration, the configuration, the shrunk
program, the explanation, the timeline, the version it was replayed on here, and a standalone reproducer that
imports only the engine (:mod:`kvfuzz.reproducers`: for scheduler traces vLLM's :mod:`kvfuzz.scheduler.reproducer`
or SGLang's :mod:`kvfuzz.reproducers.sglang_scheduler`, and a family per allocator adapter), also written beside the
report as a Python file.

The report is written to ``-o`` (default ``NAME.md`` in the current directory), the reproducer to ``NAME_reproducer.py``
beside it. A file that is not a trace, or cannot be read, is one line and exit status 2 before anything is written.
A trace no reproducer is generated for (a check that needs kvfuzz's reference, a kvfuzz allocator) gets a report
that says why and names the replay and the exported test instead. Where the trace's engine is installed the trace
is replayed (every check on) for the timeline and the verdict; elsewhere the report says it was not."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from kvfuzz.commands.options import needs_torch
from kvfuzz.commands.output_files import OutputNotWritten, check_outputs, write_text
from kvfuzz.saved.files import json_file_kind
from kvfuzz.text import printable

if TYPE_CHECKING:
    from kvfuzz.saved.trace import Trace
    from kvfuzz.scheduler.trace import SchedulerTrace


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "report", help="write a trace's report for the engine's maintainers, with a standalone reproducer"
    )
    parser.add_argument("trace", metavar="TRACE")
    parser.add_argument("-o", "--output", metavar="OUT.md", help="the report (default: NAME.md here)")
    parser.set_defaults(handler=needs_torch(run_command))


def _usage_error(message: str) -> int:
    print(f"kvfuzz: {printable(message)}", file=sys.stderr)
    return 2


def reproducer_path(report: Path) -> Path:
    """Where the reproducer of the report ``report`` is written: beside it, ``NAME_reproducer.py``."""
    return report.with_name(f"{report.stem}_reproducer.py")


def run_command(args: argparse.Namespace) -> int:
    path = Path(args.trace)
    kind = json_file_kind(path)
    report = Path(args.output) if args.output else Path(path.stem + ".md")
    try:
        check_outputs({"-o": str(report), "reproducer": str(reproducer_path(report))}, {"TRACE": args.trace})
    except ValueError as error:
        return _usage_error(str(error))
    if kind == "scheduler-trace":
        from kvfuzz.scheduler.trace import SchedulerTraceError
        from kvfuzz.scheduler.trace import load as load_scheduler_trace

        try:
            scheduler_trace = load_scheduler_trace(path)
        except SchedulerTraceError as error:
            return _usage_error(str(error))
        text, reproducer = scheduler_report(scheduler_trace, args.trace)
    else:
        from kvfuzz.saved.trace import TraceError
        from kvfuzz.saved.trace import load as load_trace

        try:
            trace = load_trace(path)
        except TraceError as error:
            return _usage_error(str(error))
        text, reproducer = allocator_report(trace, args.trace)
    try:
        if reproducer is not None:
            write_text(reproducer_path(report), reproducer)
        write_text(report, text)
    except OutputNotWritten as error:
        return _usage_error(str(error))
    written = f" and {reproducer_path(report)}" if reproducer is not None else ""
    print(f"report: {report}{written}")
    return 0


def _fenced(text: str, language: str = "text") -> str:
    """``text`` in a fenced code block whose fence no line of it can close."""
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}{language}\n{text.rstrip()}\n{fence}"


def _paragraph(text: str) -> str:
    """Trace text as Markdown prose: printable, and no character that would start markup."""
    return "".join(char if char.isprintable() or char == "\n" else " " for char in text).replace("<", "&lt;")


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
        "--cache-salts": setup.cache_salts,
        "--stop-tokens": setup.stop_tokens,
        "--eos": setup.eos,
        "--min-tokens": setup.min_tokens,
        f"--max-loras {setup.max_loras}": bool(setup.max_loras),
        f"--write-path {trace.write_path}": trace.write_path != "kvfuzz",
        f"--attention {trace.attention}": trace.attention != "off",
    }
    flags += [flag for flag, on in optional.items() if on]
    return "kvfuzz run " + " ".join(flags)


def _replayed(trace: SchedulerTrace, source: str) -> tuple[str, str]:
    """The timeline section's text and the replay's verdict line, replaying the trace where its engine is here."""
    from kvfuzz.commands.scheduler_traces import missing_engine

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
    return f"{picture}\n\n{_fenced(render_requests_text(timeline))}", f"{here}: {timeline.verdict}"


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
        f"# {trace.engine_name} {trace.vllm_version}: {_paragraph(title)}",
        "",
        f"- Engine: {trace.engine_description()}, the `{trace.scheduler}` scheduler target (the engine's own "
        "scheduler and KV-cache manager; kvfuzz plays the client and the model runner)",
        f"- Found by kvfuzz {trace.kvfuzz_version}; the command that searches this configuration: "
        f"`{run_command_line(trace)}`",
        f"- Replay it: `kvfuzz replay {source}`; export it as a pytest file (needs kvfuzz): `kvfuzz export {source}`",
        "",
        "## Configuration",
        "",
        _paragraph(trace.setup.describe()) + ".",
        "",
        "## Shrunk program" if trace.shrunk else "## Program (as first found, not shrunk)",
        "",
        "The client's operations, then the drain (steps until every request finished):",
        "",
        _fenced(program),
        "",
        "## What happened",
        "",
        _fenced(trace.failure.describe()),
        "",
        _paragraph(trace.known_bug) if trace.known_bug else "No explanation recorded beyond the failure.",
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
        sections += [f"None generated: {_paragraph(refusal)}.", ""]
    else:
        how = sglang_scheduler.HOW if trace.scheduler == SGLANG else VLLM_HOW
        sections += [
            f"It imports only {trace.engine_name}, torch and the standard library; run it in the engine's environment "
            "with `python FILE` (exit status 1 while the failure reproduces, 0 once it is fixed) or `pytest FILE`. "
            + how,
            "",
            _fenced(reproducer, "python"),
            "",
        ]
    return "\n".join(sections), reproducer


def allocator_report(trace: Trace, source: str) -> tuple[str, Optional[str]]:
    """The report of an allocator trace (an adapter drives the library's KV-cache manager), and its reproducer's
    source (:mod:`kvfuzz.reproducers`; None where none is generated)."""
    from kvfuzz.program.call import program_json
    from kvfuzz.reproducers import NotReproducible, family_of, reproducer_source

    try:
        reproducer: Optional[str] = reproducer_source(trace, source)
        engine, refusal = family_of(trace).ENGINE, ""
    except NotReproducible as error:
        reproducer, engine, refusal = None, "", str(error)
    program = "\n".join(f"{index + 1:3}  {call}" for index, call in enumerate(program_json(trace.program)))
    config = trace.config
    sections = [
        f"# {_paragraph(trace.allocator)}: invariant {trace.failure.get('invariant')} "
        f"({_paragraph(str(trace.failure.get('title')))})",
        "",
        f"- Allocator: `{_paragraph(trace.allocator)}` (a kvfuzz adapter drives the library's KV-cache manager)",
        f"- Found by kvfuzz {trace.kvfuzz_version}; the command that searches this configuration: `kvfuzz run "
        f"--allocator {trace.allocator} --block-size {config.block_size} "
        f"--num-blocks {config.num_blocks}`",
        f"- Replay it: `kvfuzz replay {source}`; draw its timeline: `kvfuzz show {source} --png OUT.png`; export it "
        f"as a pytest file (needs kvfuzz): `kvfuzz export {source}`",
        "",
        "## Shrunk program",
        "",
        _fenced(program),
        "",
        "## What happened",
        "",
        _fenced(str(trace.failure.get("explanation", ""))),
        "",
        _paragraph(trace.known_bug) if trace.known_bug else "No explanation recorded beyond the failure.",
        "",
        "## Timeline",
        "",
        f"Not included in this report: `kvfuzz show {source} --png OUT.png` draws it (a lane per block, a column "
        "per call).",
        "",
        "## Versions",
        "",
        "The tested versions it reproduces on are in kvfuzz's docs/findings.md.",
        "",
        "## Standalone reproducer",
        "",
    ]
    if reproducer is None:
        sections += [f"None generated: {_paragraph(refusal)}.", ""]
    else:
        sections += [
            f"It imports only {engine}, torch and the standard library; run it in the engine's environment with "
            "`python FILE` (exit status 1 while the failure reproduces, 0 once it is fixed) or `pytest FILE`. It "
            "builds the engine's objects as kvfuzz's adapter does, plays the shrunk program as one call per "
            "operation on a `Session` that makes the adapter's calls on them, and fails where kvfuzz's check did: "
            f"with {engine}'s own exception for a crash, otherwise with `Failure`, raised by the reproducer's own "
            "account of the K/V each slot holds (read off the block tables the engine hands out) or by a check on "
            "the engine's own state.",
            "",
            _fenced(reproducer, "python"),
            "",
        ]
    return "\n".join(sections), reproducer
