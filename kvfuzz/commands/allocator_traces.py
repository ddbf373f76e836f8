"""``kvfuzz replay``, ``show`` and ``export`` of an allocator trace (``kvfuzz-trace/1``, :mod:`kvfuzz.saved.trace`):
the allocator target's side of the trace commands (:mod:`kvfuzz.commands.trace_kinds`). Replay reports each call and
the verdict; show draws a timeline of blocks over calls; export writes a standalone pytest file. A trace naming an
allocator no :class:`~kvfuzz.registry.AllocatorTrust` rule covers is refused in one line unless
``--trust-allocator`` says its source is trusted or ``--allocator`` names the allocator to run instead."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from kvfuzz.commands.output_files import (
    OutputNotWritten,
    check_outputs,
    write_or_print,
    write_text,
    written_atomically,
)
from kvfuzz.commands.report_text import fenced, paragraph
from kvfuzz.registry import AllocatorNotFound, AllocatorTrust, UntrustedAllocator, load_factory
from kvfuzz.text import printable, printable_lines
from kvfuzz.trace_saving import default_page, show_hint

if TYPE_CHECKING:
    from kvfuzz.saved.trace import Trace


def replay_file(path: str, allocator: Optional[str], call_timeout: Optional[float], trust: AllocatorTrust) -> str:
    """Replay one allocator trace and print what happened; returns its outcome (a key of
    :data:`kvfuzz.commands.replay.OUTCOMES`). The file's name is printed escaped (:func:`kvfuzz.text.printable`): a
    directory's names are not kvfuzz's to trust."""
    name = printable(path)
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


def _usage_error(message: str) -> int:
    print(f"kvfuzz: {message}", file=sys.stderr)
    return 2


def show(args: argparse.Namespace) -> int:
    """``kvfuzz show`` of an allocator trace: its replay drawn as a timeline of blocks over calls (an HTML page, and a
    PNG with ``--png``)."""
    from kvfuzz.saved.trace import TraceError
    from kvfuzz.saved.trace import load as load_trace

    try:
        trace = load_trace(Path(args.trace))
    except TraceError as error:
        return _usage_error(str(error))
    page = Path(args.html) if args.html else default_page(Path(args.trace))
    try:  # the default page too: a trace named NAME.html is its own default page
        check_outputs({"--html": str(page), "--png": args.png}, {"TRACE": args.trace})
    except ValueError as error:
        return _usage_error(str(error))
    if args.png is not None:
        try:
            import matplotlib  # noqa: F401 -- only whether the plot extra is installed
        except ImportError:
            return _usage_error("--png needs matplotlib: pip install 'kvfuzz[plot]'")
    if args.allocator is not None:
        try:
            load_factory(args.allocator)
        except AllocatorNotFound as error:
            return _usage_error(str(error))
    from kvfuzz.timeline.html import render_html
    from kvfuzz.timeline.record import record

    name = printable(args.trace)  # a file name that is not UTF-8 prints (and goes into the page) escaped
    started = time.perf_counter()
    try:
        timeline = record(trace, name, args.allocator, trust=AllocatorTrust(everything=args.trust_allocator))
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # building the allocator or its engine failed or exited: one line, as replay says
        one_line = " ".join(f"{type(error).__name__}: {error}".split())
        return _usage_error(f"{name}: replay could not start: {one_line}")
    try:
        write_text(page, render_html(timeline))
        if args.png is not None:
            from kvfuzz.timeline.png import render_png

            with written_atomically(Path(args.png)) as picture:
                render_png(timeline, picture)
    except OutputNotWritten as error:
        return _usage_error(str(error))
    for note in timeline.notes:
        print(f"note: {printable_lines(note)}")
    outcome = timeline.outcome
    where = f" at call {timeline.columns[outcome.column].call_index + 1}" if outcome.column is not None else ""
    print(f"{name}: {printable(outcome.title)}: {outcome.verdict}{where} against {timeline.allocator}")
    pictures = f"{printable(str(page))}" + (f" and {printable(args.png)}" if args.png else "")
    print(f"timeline: {pictures} ({time.perf_counter() - started:.2f} s)")
    return 0


def export(args: argparse.Namespace) -> int:
    """``kvfuzz export`` of an allocator trace: a standalone pytest file replaying it."""
    from kvfuzz.saved.corpus import export_test
    from kvfuzz.saved.trace import TraceError
    from kvfuzz.saved.trace import load as load_trace

    try:
        trace = load_trace(Path(args.trace))
        if args.allocator is None:
            AllocatorTrust(everything=args.trust_allocator).check(trace.allocator)
    except TraceError as error:
        print(f"kvfuzz: {error}", file=sys.stderr)
        return 2
    except UntrustedAllocator as error:
        print(
            f"kvfuzz: {args.trace}: {error}: the exported test would do so when run; export a test of an allocator "
            "you name (--allocator SPEC), or pass --trust-allocator if you trust where the trace came from",
            file=sys.stderr,
        )
        return 2
    return write_or_print(export_test(trace, args.trace, args.allocator), args.output, "pytest {path}")


def report(path: str) -> tuple[str, Optional[str]]:
    """``kvfuzz report`` of an allocator trace: the report's text, and its reproducer's source (None where none is
    generated); raises :class:`~kvfuzz.saved.trace.TraceError` for a file that is not a valid one."""
    from kvfuzz.saved.trace import load

    return allocator_report(load(Path(path)), path)


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
        f"# {paragraph(trace.allocator)}: invariant {trace.failure.get('invariant')} "
        f"({paragraph(str(trace.failure.get('title')))})",
        "",
        f"- Allocator: `{paragraph(trace.allocator)}` (a kvfuzz adapter drives the library's KV-cache manager)",
        f"- Found by kvfuzz {trace.kvfuzz_version}; the command that searches this configuration: `kvfuzz run "
        f"--allocator {trace.allocator} --block-size {config.block_size} "
        f"--num-blocks {config.num_blocks}`",
        f"- Replay it: `kvfuzz replay {source}`; draw its timeline: `kvfuzz show {source} --png OUT.png`; export it "
        f"as a pytest file (needs kvfuzz): `kvfuzz export {source}`",
        "",
        "## Shrunk program",
        "",
        fenced(program),
        "",
        "## What happened",
        "",
        fenced(str(trace.failure.get("explanation", ""))),
        "",
        paragraph(trace.known_bug) if trace.known_bug else "No explanation recorded beyond the failure.",
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
        sections += [f"None generated: {paragraph(refusal)}.", ""]
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
            fenced(reproducer, "python"),
            "",
        ]
    return "\n".join(sections), reproducer
