"""``kvfuzz run``: the machine against one allocator; a failure's trace is saved to the corpus."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from kvfuzz.commands.json_stdout import emit_json
from kvfuzz.commands.options import (
    DEFAULT_CORPUS,
    check_database,
    machine_arguments,
    machine_config,
    needs_torch,
    run_examples,
)
from kvfuzz.last_words import last_words
from kvfuzz.option_defaults import KERNEL_NAMES, SCHEDULER_NAMES
from kvfuzz.registry import DEFAULT_ALLOCATOR, AllocatorFactory, AllocatorNotFound, load_factory, probe_allocator
from kvfuzz.scheduler.command import add_arguments as scheduler_arguments
from kvfuzz.scheduler.command import run_scheduler, usage_error
from kvfuzz.text import plural

if TYPE_CHECKING:
    from kvfuzz.engine.config import MachineConfig
    from kvfuzz.isolated_run import Died
    from kvfuzz.runner import RunSummary
    from kvfuzz.saved.corpus import HangSaver
    from kvfuzz.saved.trace import Trace


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("run", help="run the machine against an allocator, or a real scheduler")
    target = parser.add_mutually_exclusive_group()
    target.add_argument(
        "--allocator",
        default=DEFAULT_ALLOCATOR,
        help=f"MODULE:FACTORY called with a PoolSpec (default {DEFAULT_ALLOCATOR}); "
        "zoo:NAME for a broken allocator from kvfuzz's zoo",
    )
    target.add_argument(
        "--scheduler",
        choices=SCHEDULER_NAMES,
        help="instead of an allocator, a real engine scheduler that decides for itself, kvfuzz playing its model "
        "runner (docs/scheduler.md)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument(
        "--corpus",
        default=DEFAULT_CORPUS,
        metavar="DIR",
        help=f"where a failure's trace is saved (default {DEFAULT_CORPUS}, which pytest does not collect)",
    )
    parser.add_argument(
        "--database",
        metavar="URL|DIR",
        help="Hypothesis example database, redis://HOST:PORT/N or a directory: failing examples are saved there and "
        "tried first by the next run (share it between CI runs); makes the run random, not seeded",
    )
    parser.add_argument(
        "--kernel",
        choices=KERNEL_NAMES,
        default="gather",
        help="attention kernel of invariant 2: gather (the reference's, bitwise; default), "
        "flex (FlexAttention over the paged pools, eager, within a tolerance), allocator "
        "(the allocator's own paged attention, if it declares one), vllm-triton and sglang-triton (the engines' Triton "
        "attention, from the installed engine; Triton's interpreter on CPU), and with --device cuda only "
        "flex-compiled, flashinfer, flashinfer-prefill; saved in traces",
    )
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="run the allocator in a child process: a segfault or an abort in it is reported by this run, with its "
        "program saved as a trace (docs/failures.md); costs a second interpreter's start (with --scheduler: the "
        "examples in a child forked from this process, docs/scheduler.md)",
    )
    machine_arguments(parser)
    scheduler_arguments(parser)
    parser.set_defaults(handler=needs_torch(run_command))


def _print_summary(summary: RunSummary, config: MachineConfig) -> None:
    verdict = "FAILED" if summary.failed else "passed"
    print(
        f"{verdict}: {plural(summary.examples, 'example')}, {plural(summary.steps, 'step')} in {summary.seconds:.1f} s "
        f"({summary.steps_per_second:.0f} steps/s)"
    )
    print(
        f"operations (random programs over the whole table and over {plural(summary.swarms, 'weighted subset')} "
        "of it, Hypothesis's examples over rules it switches off per example):"
    )
    width = max((len(name) for name in summary.operations), default=0)
    for name, count in summary.operations.items():
        print(f"  {name:<{width}}  {count}")
    if summary.occupancy is not None:
        print("\n".join(summary.occupancy.describe()))
    if summary.failed:
        first = (
            f" (first failing example: #{summary.first_failure_examples}, after {summary.first_failure_seconds:.2f} s)"
            if summary.first_failure_seconds is not None
            else ""
        )
        print(
            f"\n{summary.invariant}{first}\n\n{'shrunk' if summary.shrunk else 'failing'} program "
            f"({plural(summary.program_length, 'operation')}):"
        )
        print(summary.program or "  (no program was printed)")
        pool = summary.describe_pool()
        if pool is not None:
            print(f"({pool})")
        if summary.shrink_note is not None:
            print(f"({summary.shrink_note})")
        print(f"\n{summary.explanation}")
        if summary.flaky:
            print(
                f"\nFLAKY: the program above reproduced the failure in {summary.reproduced} of "
                f"{plural(summary.replays, 'replay')} on fresh allocators: the allocator does not behave the same "
                "way every time (a race, a hash seed, an uninitialised read)"
            )
        elif summary.replays:
            print(f"\nconfirmed: the program reproduces the failure in {summary.replays} of {summary.replays} replays")
    if summary.interrupted:
        found = "; the failure found so far is above" if summary.failed else "; no failure found"
        print(f"\ninterrupted after {plural(summary.examples, 'example')}{found}")


def _report(
    summary: RunSummary,
    trace: Optional[Trace],
    args: argparse.Namespace,
    config: MachineConfig,
    found: Optional[Path] = None,
) -> int:
    """Print the run's outcome, then save a failure's ``trace``: the failure is on the terminal before the corpus is
    touched, and a trace that cannot be saved is printed whole. A hang saved as found (at ``found``) is removed once
    the shrunk hang is saved and confirmed, and said to stay otherwise. The exit status is 130 for a run the user
    interrupted (its failure, if any, saved all the same), else 1 for any failure, saved or not, and 0.

    With ``--json``, standard output stays one JSON object: ``trace`` is the saved file (or null), ``trace_error``
    why it could not be saved (or null), and ``unsaved_trace`` the trace itself when it could not be saved; after a
    hang saved as found, ``hang_as_found`` is that file while it stays (or null)."""
    from kvfuzz.saved.corpus import save_trace, superseded
    from kvfuzz.trace_saving import NO_TRACE_FIELDS

    if not args.json:
        _print_summary(summary, config)
        sys.stdout.flush()
    saved = save_trace(trace, Path(args.corpus)) if trace is not None else None
    stays = found is not None and superseded(found, saved, summary) is None
    if args.json:
        fields = dict(NO_TRACE_FIELDS if saved is None else saved.json_fields())
        if fields["trace_error"] is not None:
            print(
                f"kvfuzz: trace NOT saved: {fields['trace_error']}; it is in the JSON object's unsaved_trace",
                file=sys.stderr,
            )
        if found is not None:
            fields["hang_as_found"] = str(found) if stays else None
        emit_json({**summary.to_json(), **fields})
    else:
        if saved is not None:
            print(f"\n{saved.report()}")
        if found is not None:
            print(f"the hang as found stays saved at {found}" if stays else f"(it replaces {found}, the hang as found)")
    if summary.interrupted:
        return 130
    return 1 if summary.failed else 0


def _enable_faulthandler() -> None:
    """A segfault in the allocator prints where it happened (the journal keeps the program); where standard error
    is not a real file (kvfuzz called in-process under capture), the journal alone keeps it."""
    if not faulthandler.is_enabled():
        with contextlib.suppress(io.UnsupportedOperation, AttributeError, ValueError):
            faulthandler.enable()


def _journal_dir(corpus: Path) -> Optional[Path]:
    """The corpus, if the run can keep its journal there (and recover the journals of runs that died); else None,
    after one line saying what a crash would cost."""
    from kvfuzz.saved import journals

    try:
        corpus.mkdir(parents=True, exist_ok=True)
        for recovered in journals.recover(corpus):
            print(f"kvfuzz: {recovered.message}", file=sys.stderr)
        probe = corpus / f".kvfuzz-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        print(
            f"kvfuzz: cannot keep a journal in {corpus} ({error.strerror or error}): if the allocator kills the "
            "process, the program it was running is lost",
            file=sys.stderr,
        )
        return None
    return corpus


def _report_death(died: Died, args: argparse.Namespace, factory: AllocatorFactory) -> int:
    """The isolated child died without a result: the allocator ended it, by a signal or by exiting in the middle of
    an example (exit status 1, its program saved from its journal), or it exited outside the allocator's calls,
    which kvfuzz's own run never does (exit status 3)."""
    from kvfuzz.saved.corpus import PROCESS_DIED
    from kvfuzz.statemachines.machine import machine_for

    status = 1 if died.killed else 3
    machine = machine_for(factory, died.trace.config).__name__ if died.trace is not None else ""
    if args.json:
        fields = {
            "allocator": args.allocator,
            "failed": died.killed,
            "isolated_child": died.how,
            "invariant": PROCESS_DIED if died.killed else None,
            "program": died.program(machine),
            "program_length": len(died.trace.program) if died.trace is not None else None,
            "explanation": str(died.trace.failure.get("explanation", "")) if died.trace is not None else None,
            "trace": str(died.path) if died.path is not None else None,
            "trace_error": None if died.path is not None else died.message,
        }
        emit_json(fields)
    elif died.killed:
        print(f"FAILED: {died.describe(machine)}")
    else:
        print(f"kvfuzz: {died.describe(machine)}", file=sys.stderr)
    return status


def _hang_saver(args: argparse.Namespace, config: MachineConfig, journal_dir: Optional[Path]) -> HangSaver:
    """Saves a hang in the corpus (``journal_dir``: None where it cannot be written) as soon as it is found."""
    from kvfuzz.saved.corpus import HangSaver

    return HangSaver(
        args.allocator, config, journal_dir, lambda line: print(f"kvfuzz: {line}", file=sys.stderr, flush=True)
    )


def _run_isolated(args: argparse.Namespace, config: MachineConfig, factory: AllocatorFactory) -> int:
    """``--isolate``: the run in a child process (:mod:`kvfuzz.isolated_run`), reported here as without it."""
    from kvfuzz.isolated_run import Died, RunRequest, Stopped, run_isolated
    from kvfuzz.program.safeguards import deferred_interrupts

    outcome = run_isolated(
        RunRequest(
            args.allocator,
            config,
            examples=args.examples,
            steps=args.steps,
            seed=args.seed,
            shrink=not args.no_shrink,
            database=args.database,
            call_timeout=args.call_timeout or None,
            journal_dir=_journal_dir(Path(args.corpus)),
            progress=not args.json,
        )
    )
    with deferred_interrupts() as pressed:
        if isinstance(outcome, Stopped):
            if args.json:
                emit_json({"allocator": args.allocator, "failed": False, "interrupted": True})
            else:
                print("interrupted before the isolated run had a result; no failure found")
            return 130
        if isinstance(outcome, Died):
            return _report_death(outcome, args, factory)
        status = _report(outcome.summary, outcome.trace, args, config, outcome.hang_as_found)
    return 130 if pressed else status


def _dying_words(journal_dir: Optional[Path], corpus: str) -> contextlib.AbstractContextManager[None]:
    """Without ``--isolate``: if the allocator kills this process, a last line names its journal and the command
    that turns it into a trace (:mod:`kvfuzz.last_words`)."""
    from kvfuzz.program.safeguards import journal_path

    if journal_dir is None:
        return contextlib.nullcontext()
    journal = journal_path(journal_dir)
    return last_words(
        journal,
        f"kvfuzz: this run (pid {os.getpid()}) died; the program it was running is in its journal {journal}: the "
        f"next `kvfuzz run --corpus {shlex.quote(corpus)}` turns it into a trace first thing (with --isolate, the run "
        "reports such a death itself)",
    )


def run_command(args: argparse.Namespace) -> int:
    args.examples = run_examples(args.examples, args.scheduler)
    if args.scheduler is not None or usage_error(args) is not None:
        from kvfuzz.commands.scheduler_isolated import run_isolated as run_scheduler_isolated

        # a scheduler target, or a scheduler's option without one (refused); its example database checked as the
        # allocator's is, before any work
        database = None
        if args.scheduler is not None and args.database is not None:
            from kvfuzz.campaign.store import open_examples

            try:
                if args.seed is not None:
                    raise ValueError(
                        "--seed and --database cannot be combined (Hypothesis ignores the database under a seed)"
                    )
                check_database(args.database)
            except ValueError as error:
                print(f"kvfuzz: {error}", file=sys.stderr)
                return 2
            database = open_examples(args.database, Path(args.database))
        return run_scheduler(args, emit_json, run_scheduler_isolated, database)
    from kvfuzz.program.safeguards import exits_as_crashes

    # From before the allocator's module is imported: one that takes os._exit at import (``from os import _exit``)
    # takes the interception, and its exit is a crash found like any other.
    with exits_as_crashes():
        return _run_allocator(args)


def _run_allocator(args: argparse.Namespace) -> int:
    """``kvfuzz run`` of an allocator: every check, then the run, in this process or isolated."""
    import attrs

    from kvfuzz.campaign.store import open_examples
    from kvfuzz.kernels import make_kernel, prepare_kernel
    from kvfuzz.program.safeguards import deferred_interrupts
    from kvfuzz.runner import run
    from kvfuzz.saved.corpus import trace_of

    try:  # every check before any work: nothing is printed on standard output, nothing written, until all pass
        config = attrs.evolve(machine_config(args), kernel=args.kernel)
        if args.database is not None and args.seed is not None:
            raise ValueError("--seed and --database cannot be combined (Hypothesis ignores the database under a seed)")
        check_database(args.database)
        prepare_kernel(config.kernel, config.shape)  # before the allocator's package, and so its engine, loads
        factory = load_factory(args.allocator)
        probe = probe_allocator(args.allocator, factory, config.pool_spec())  # never driven: checked before work
        make_kernel(config.kernel, probe, config.shape)
    except (AllocatorNotFound, ValueError) as error:
        print(f"kvfuzz: {error}", file=sys.stderr)
        return 2
    progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    if not args.json:
        shape = config.shape
        if args.seed is not None:
            search = f"seed {args.seed}"
        elif args.database is not None:
            search = f"random, example database {args.database}"
        else:
            search = "derandomized"
        print(
            f"kvfuzz run: {args.allocator}\n  pool: {plural(config.num_blocks, 'block')} x "
            f"{plural(config.block_size, 'slot')}, {plural(config.num_host_blocks, 'host block')}; model: "
            f"{plural(shape.num_layers, 'layer')}, {shape.num_kv_heads} KV / "
            f"{plural(shape.num_query_heads, 'query head')}, head dim {shape.head_dim}, {args.dtype} on "
            f"{shape.device}, {config.kernel} attention kernel\n"
            f"  {plural(args.examples, 'example')} of up to {plural(args.steps, 'step')}, {search}"
            + (", the allocator in a child process (--isolate)" if args.isolate else ""),
            flush=True,
        )
    if args.isolate:
        return _run_isolated(args, config, factory)
    database = None if args.database is None else open_examples(args.database, Path(args.database))
    _enable_faulthandler()
    journal_dir = _journal_dir(Path(args.corpus))
    hang_saver = _hang_saver(args, config, journal_dir)
    # Ctrl-C outside the run (which stops with what it found) would lose a failure not yet saved: it waits.
    with deferred_interrupts() as pressed:
        with _dying_words(journal_dir, args.corpus):
            summary = run(
                factory,
                config,
                examples=args.examples,
                steps=args.steps,
                seed=args.seed,
                allocator_name=args.allocator,
                shrink=not args.no_shrink,
                database=database,
                progress=progress,
                call_timeout=args.call_timeout or None,
                journal_dir=journal_dir,
                on_hang=hang_saver,
            )
        status = _report(summary, trace_of(summary, args.allocator, config), args, config, hang_saver.path)
    return 130 if pressed else status
