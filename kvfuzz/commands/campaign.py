"""``kvfuzz campaign``: every distinct failure kvfuzz can reach in a time budget, on every core (see
:mod:`kvfuzz.campaign`)."""

from __future__ import annotations

import argparse
import fnmatch
import os
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvfuzz.commands.coverage_report import coverage_html_problem, write_coverage_report
from kvfuzz.commands.json_stdout import emit_json
from kvfuzz.commands.options import (
    DEFAULT_CORPUS,
    at_least,
    at_least_seconds,
    check_database,
    needs_torch,
    positive_seconds,
    workers_problem,
)
from kvfuzz.commands.scheduler_campaign import add_arguments as scheduler_arguments
from kvfuzz.commands.scheduler_campaign import scheduler_campaign
from kvfuzz.commands.scheduler_campaign import usage_error as scheduler_usage_error
from kvfuzz.option_defaults import CALL_TIMEOUT, CAMPAIGN_DURATION
from kvfuzz.registry import DEFAULT_ALLOCATOR, AllocatorNotFound, AllocatorUnusable, load_factory, registered_allocators
from kvfuzz.text import plural

if TYPE_CHECKING:
    from kvfuzz.campaign.report import CampaignResult
    from kvfuzz.campaign.supervisor import CampaignOptions


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "campaign",
        help="search for every distinct failure in a time budget, on every core, over swarmed configurations",
    )
    parser.add_argument(
        "--allocator",
        action="append",
        metavar="SPEC",
        help=f"an allocator (MODULE:FACTORY, zoo:NAME, a registered name), or a pattern over the registered and zoo "
        f"names ('kvfuzz*', 'zoo:*'); repeatable: the work is spread over all of them (default {DEFAULT_ALLOCATOR})",
    )
    parser.add_argument(
        "--duration",
        type=positive_seconds,
        metavar="SECONDS",
        help=f"stop after this long (default {CAMPAIGN_DURATION:g})",
    )
    parser.add_argument("--max-examples", type=at_least(1), metavar="N", help="stop after N programs")
    parser.add_argument("--stop-after", type=at_least(1), metavar="N", help="stop after N new distinct failures")
    parser.add_argument(
        "--workers",
        type=at_least(1),
        metavar="N",
        help=f"worker processes (default: the cores, {os.cpu_count()}; with --scheduler, 1)",
    )
    parser.add_argument(
        "--database",
        metavar="URL|DIR",
        help="shared state: redis://HOST:PORT/N (Hypothesis's example database and the failure signatures, shared "
        "by campaigns on several machines), or an example-database directory (default: inside the corpus)",
    )
    parser.add_argument(
        "--corpus",
        default=DEFAULT_CORPUS,
        metavar="DIR",
        help=f"where new failures are saved as traces (default {DEFAULT_CORPUS}, which pytest does not collect)",
    )
    known = parser.add_mutually_exclusive_group()
    known.add_argument(
        "--known",
        action="append",
        metavar="DIR",
        help="a corpus whose traces are known findings, counted and not reported as new; repeatable "
        "(default: ./corpus when it exists)",
    )
    known.add_argument(
        "--no-known", action="store_true", help="no known corpus, not even ./corpus (the campaign's own still counts)"
    )
    parser.add_argument(
        "--seed", type=int, help="the campaign's seed (default: drawn at random; printed, and in the rerun command)"
    )
    parser.add_argument(
        "--shrink-time",
        type=positive_seconds,
        metavar="SECONDS",
        help="the time bound of shrinking one failure (default 30)",
    )
    parser.add_argument(
        "--call-timeout",
        type=at_least_seconds,
        default=CALL_TIMEOUT,
        metavar="SECONDS",
        help=f"an operation still running after this long is a hang (default {CALL_TIMEOUT:g}; 0: no watchdog)",
    )
    parser.add_argument(
        "--pin",
        action="append",
        metavar="ROW=VALUE",
        help="hold a row of the target's swarm table at one value in every batch (repeatable): for allocators "
        "num_blocks, block_size, host_blocks, program_length, operations (names, comma-separated), window; for a "
        'scheduler e.g. async_scheduling=true, model=sliding-window (docs/campaigns.md, "One row at a time")',
    )
    parser.add_argument(
        "--coverage",
        action="store_true",
        default=None,
        help="measure the line and branch coverage of the code under test: the allocators' own code, or the "
        "scheduler's engine (docs/coverage.md)",
    )
    parser.add_argument(
        "--coverage-html",
        metavar="DIR",
        help="write an HTML report of the code under test's lines reached and missed into DIR (implies --coverage)",
    )
    parser.add_argument(
        "--guided",
        action="store_true",
        default=None,
        help="coverage-guided search: keep programs that reach new coverage as seeds and mutate them, and give more "
        "batches to the configurations still finding coverage (implies --coverage; docs/coverage.md)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    scheduler_arguments(parser)
    parser.set_defaults(handler=needs_torch(campaign_command))


def expand_allocators(specs: list[str]) -> tuple[str, ...]:
    """The allocator set: each spec as given, or a pattern expanded over the registered names and ``zoo:NAME``s;
    ``AllocatorNotFound`` for a pattern that matches nothing. Duplicates are dropped, the order kept."""
    from kvfuzz.zoo import VARIANTS

    names = [*registered_allocators(), *(f"zoo:{variant.name}" for variant in VARIANTS)]
    expanded: list[str] = []
    for spec in specs:
        if any(char in spec for char in "*?["):
            matched = [name for name in names if fnmatch.fnmatchcase(name, spec)]
            if not matched:
                raise AllocatorNotFound(f"--allocator {spec!r}: the pattern matches no registered or zoo allocator")
            expanded += matched
        else:
            expanded.append(spec)
    return tuple(dict.fromkeys(expanded))


def _options(args: argparse.Namespace) -> CampaignOptions:
    """Every check before any work; ``ValueError`` or ``AllocatorNotFound``/``AllocatorUnusable`` (one line)."""
    from kvfuzz.campaign.supervisor import DEFAULT_DURATION, CampaignOptions
    from kvfuzz.campaign.swarm import Limits, allocator_rows, builds_pinned, probe_limits
    from kvfuzz.coverage.scope import allocator_scope
    from kvfuzz.engine.config import MachineConfig
    from kvfuzz.swarm_table import Pins, describe_pins, parse_pins

    cores = os.cpu_count() or 1
    workers = args.workers if args.workers is not None else cores
    problem = workers_problem(workers)
    if problem is not None:
        raise ValueError(problem)
    corpus = Path(args.corpus)
    if corpus.exists() and not corpus.is_dir():
        raise ValueError(f"--corpus {args.corpus}: not a directory")
    database = args.database
    check_database(database)
    if args.no_known:
        known = []
    elif args.known:
        known = [Path(path) for path in args.known]
    else:
        known = [Path("corpus")] if Path("corpus").is_dir() else []
    for path in known:
        if not path.is_dir():
            raise ValueError(f"--known {path}: not a directory")
    problem = coverage_html_problem(args.coverage_html)
    if problem is not None:
        raise ValueError(problem)
    allocators = expand_allocators(args.allocator or [DEFAULT_ALLOCATOR])
    factories = {spec: load_factory(spec) for spec in allocators}
    limits: list[Limits] = [probe_limits(spec, factories[spec], MachineConfig()) for spec in allocators]
    coverage = bool(args.coverage or args.guided or args.coverage_html is not None)
    measured = "guided" if args.guided else "coverage"
    if coverage and not any(allocator_scope(factory).files() for factory in factories.values()):
        raise ValueError(
            f"--{measured}: {', '.join(allocators)}: no Python code under test to measure (an adapter over a C++ "
            "allocator, or a factory of kvfuzz's own harness; docs/coverage.md)"
        )
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    pins: Pins = ()
    tables = [allocator_rows(limit) for limit in limits]
    differ = len({tuple((row.name, row.pinnable) for row in rows) for rows in tables}) > 1  # a refusal names whose
    for spec, limit, rows in zip(allocators, limits, tables):  # every allocator's table takes the pins
        pins = parse_pins(args.pin or (), rows, f" for {spec}" if differ else "")  # PinRefused: a ValueError
        if pins and not builds_pinned(limit, factories[spec], MachineConfig(), dict(pins), seed):
            raise ValueError(f"--pin {describe_pins(pins)}: {spec} builds the pool of no configuration with these pins")
    duration = args.duration if args.duration is not None else (None if args.max_examples else DEFAULT_DURATION)
    return CampaignOptions(
        allocators,
        tuple(limits),
        workers,
        corpus,
        duration=duration,
        max_examples=args.max_examples,
        stop_after=args.stop_after,
        known=tuple(known),
        database=database,
        seed=seed,
        call_timeout=args.call_timeout or None,
        shrink_seconds=args.shrink_time if args.shrink_time is not None else 30.0,
        pins=pins,
        coverage=coverage,
        guided=bool(args.guided),
    )


def campaign_command(args: argparse.Namespace) -> int:
    """Exit status: 2 for bad input (or a corpus another campaign holds), 128 + the signal's number when Ctrl-C
    (130), SIGTERM (143) or SIGHUP (129) ended it, 3 when every worker failed in kvfuzz itself, else 1 for a new
    failure and 0. A signal never loses what was found: the table is printed and every claimed failure saved."""
    from kvfuzz.campaign.supervisor import Campaign
    from kvfuzz.program.safeguards import deferred_interrupts

    if args.scheduler is not None or scheduler_usage_error(args) is not None:
        return scheduler_campaign(args, emit_json)  # a scheduler campaign, or a scheduler's option without one
    status_line = _StatusLine(sys.stderr.isatty())
    try:
        options = _options(args)
        campaign = Campaign(options, status=status_line.update, event=status_line.event)
    except (AllocatorNotFound, AllocatorUnusable, ValueError) as error:
        print(f"kvfuzz: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"kvfuzz: --corpus {args.corpus}: cannot write its campaign state ({error})", file=sys.stderr)
        return 2
    # A signal while the result is printed waits for it (the campaign itself records them while it runs).
    with deferred_interrupts():
        if not args.json:
            print(_header(options), flush=True)
        result = campaign.run()
        status_line.close()
        if args.json:
            emit_json(result.to_json())
        else:
            _print_result(result)
        title = f"kvfuzz campaign {', '.join(options.allocators)}, seed {options.seed}"
        write_coverage_report(args.coverage_html, result, title)
    if campaign.signal is not None:
        return 128 + campaign.signal
    if result.errors and not result.findings:
        return 3
    return 1 if result.new else 0


def _header(options: CampaignOptions) -> str:
    from kvfuzz.campaign.swarm import MAX_BLOCKS, MAX_PROGRAM_LENGTH
    from kvfuzz.program.operations import OPERATIONS
    from kvfuzz.swarm_table import describe_pins

    until = [f"{options.duration:g} s" if options.duration else None]
    until += [plural(options.max_examples, "example") if options.max_examples else None]
    until += [f"{plural(options.stop_after, 'new failure')}" if options.stop_after else None]
    ends = " or ".join(part for part in until if part)
    block_sizes = sorted({size for limits in options.limits for size in limits.block_sizes})
    known = ", ".join([*map(str, options.known), f"{options.corpus} (its own corpus)"])
    return (
        f"kvfuzz campaign: {', '.join(options.allocators)}\n"
        f"  {plural(options.workers, 'worker')}, until {ends}, seed {options.seed}; each batch draws its pool "
        f"(up to {MAX_BLOCKS} blocks of {'/'.join(map(str, block_sizes))} slots), program length (up to "
        f"{MAX_PROGRAM_LENGTH} calls) and a subset of the {len(OPERATIONS)} operations\n"
        f"  new failures saved to {options.corpus}; known findings from: {known}; shared state: "
        f"{options.database or 'local'}"
        + (f"\n  pinned: {describe_pins(options.pins)}" if options.pins else "")
        + (
            "\n  coverage-guided: programs reaching new code of the allocators kept as seeds and mutated"
            if options.guided
            else ""
        )
        + (
            "\n  coverage of the allocators' own code measured (docs/coverage.md)"
            if options.coverage and not options.guided
            else ""
        )
    )


class _StatusLine:
    """The one updating progress line on standard error (rewritten in place on a terminal; elsewhere a line every
    ten seconds), with event lines printed above it."""

    def __init__(self, terminal: bool) -> None:
        self.terminal = terminal
        self.shown = False
        self.last_printed = 0.0
        self.line = ""

    def update(self, line: str) -> None:
        self.line = line
        if self.terminal:
            sys.stderr.write(f"\r\x1b[K{line}")
            sys.stderr.flush()
            self.shown = True
        elif time.monotonic() - self.last_printed >= 10:
            self.last_printed = time.monotonic()
            print(f"  {line}", file=sys.stderr, flush=True)

    def event(self, line: str) -> None:
        if self.terminal and self.shown:
            sys.stderr.write("\r\x1b[K")
        print(line, file=sys.stderr, flush=True)
        if self.terminal and self.line:
            sys.stderr.write(self.line)
            sys.stderr.flush()

    def close(self) -> None:
        if self.terminal and self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _print_result(result: CampaignResult) -> None:
    from kvfuzz.campaign.report import new_finding_lines, table

    print("\n".join(table(result) + new_finding_lines(result.new)))
