"""``kvfuzz run``: the machine against one allocator; a failure's trace is saved to the corpus."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import json
import os
import sys
from pathlib import Path
from typing import Optional

import attrs
from hypothesis.database import DirectoryBasedExampleDatabase

from kvfuzz.commands.options import machine_arguments, machine_config
from kvfuzz.engine.config import MachineConfig
from kvfuzz.kernels import KERNEL_NAMES, make_kernel
from kvfuzz.program.safeguards import deferred_interrupts
from kvfuzz.registry import DEFAULT_ALLOCATOR, AllocatorNotFound, load_factory, probe_allocator
from kvfuzz.runner import RunSummary, run
from kvfuzz.saved import journals
from kvfuzz.saved.corpus import save_failure
from kvfuzz.text import plural


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("run", help="run the machine against an allocator")
    parser.add_argument(
        "--allocator",
        default=DEFAULT_ALLOCATOR,
        help=f"MODULE:FACTORY called with a PoolSpec (default {DEFAULT_ALLOCATOR}); "
        "zoo:NAME for a broken allocator from kvfuzz's zoo",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument(
        "--corpus", default="corpus", metavar="DIR", help="where a failure's trace is saved (default: corpus)"
    )
    parser.add_argument(
        "--database",
        metavar="DIR",
        help="Hypothesis example database: failing examples are saved there and tried first "
        "by the next run (share it between CI runs); makes the run random, not seeded",
    )
    parser.add_argument(
        "--kernel",
        choices=KERNEL_NAMES,
        default="gather",
        help="attention kernel of invariant 2: gather (the reference's, bitwise; default), "
        "flex (FlexAttention over the paged pools, eager, within a tolerance), allocator "
        "(the allocator's own paged attention, if it declares one); saved in traces",
    )
    machine_arguments(parser)
    parser.set_defaults(handler=run_command)


def _print_summary(summary: RunSummary, config: MachineConfig) -> None:
    verdict = "FAILED" if summary.failed else "passed"
    print(
        f"{verdict}: {plural(summary.examples, 'example')}, {plural(summary.steps, 'step')} in {summary.seconds:.1f} s "
        f"({summary.steps_per_second:.0f} steps/s)"
    )
    print("operations:")
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


def _report(summary: RunSummary, args: argparse.Namespace, config: MachineConfig) -> int:
    """Print the run's outcome, then save a failure's trace: the failure is on the terminal before the corpus is
    touched, and a trace that cannot be saved is printed whole. The exit status is 130 for a run the user
    interrupted (its failure, if any, saved all the same), else 1 for any failure, saved or not, and 0.

    With ``--json``, standard output stays one JSON object: ``trace`` is the saved file (or null), ``trace_error``
    why it could not be saved (or null), and ``unsaved_trace`` the trace itself when it could not be saved."""
    if not args.json:
        _print_summary(summary, config)
        sys.stdout.flush()
    saved = save_failure(summary, args.allocator, config, Path(args.corpus)) if summary.failed else None
    if args.json:
        unsaved = saved is not None and saved.error is not None
        error = f"cannot write {saved.path} ({saved.error})" if saved is not None and unsaved else None
        if error is not None:
            print(f"kvfuzz: trace NOT saved: {error}; it is in the JSON object's unsaved_trace", file=sys.stderr)
        fields = {
            "trace": str(saved.path) if saved is not None and not unsaved else None,
            "trace_error": error,
            "unsaved_trace": saved.trace.to_json() if saved is not None and unsaved else None,
        }
        print(json.dumps({**summary.to_json(), **fields}, indent=2))
    elif saved is not None:
        print(f"\n{saved.report()}")
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


def run_command(args: argparse.Namespace) -> int:
    try:  # every check before any work: nothing is printed on standard output, nothing written, until all pass
        config = attrs.evolve(machine_config(args), kernel=args.kernel)
        if args.database is not None and args.seed is not None:
            raise ValueError("--seed and --database cannot be combined (Hypothesis ignores the database under a seed)")
        factory = load_factory(args.allocator)
        probe = probe_allocator(args.allocator, factory, config.pool_spec())  # never driven: checked before work
        make_kernel(config.kernel, probe)
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
            f"  {plural(args.examples, 'example')} of up to {plural(args.steps, 'step')}, {search}",
            flush=True,
        )
    database = DirectoryBasedExampleDatabase(args.database) if args.database else None
    _enable_faulthandler()
    # Ctrl-C outside the run (which stops with what it found) would lose a failure not yet saved: it waits.
    with deferred_interrupts() as pressed:
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
            journal_dir=_journal_dir(Path(args.corpus)),
        )
        status = _report(summary, args, config)
    return 130 if pressed else status
