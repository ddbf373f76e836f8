"""``kvfuzz campaign --scheduler NAME``: a campaign against a real scheduler (docs/scheduler-campaigns.md), its usage
errors one line and exit status 2 before any work: options only an allocator campaign takes, options only a scheduler
campaign takes given without ``--scheduler``, the engine not installed here or of a version kvfuzz is not tested on
(without ``--untested-engine``)."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from kvfuzz.commands.coverage_report import coverage_html_problem, write_coverage_report
from kvfuzz.commands.options import positive_seconds
from kvfuzz.text import plural

if TYPE_CHECKING:
    from kvfuzz.campaign.scheduler.target import SchedulerTarget
    from kvfuzz.swarm_table import Dimension

ALLOCATOR_ONLY = (("shrink_time", None, "--shrink-time (Hypothesis bounds a scheduler failure's shrinking itself)"),)
"""(attribute, its default, what to say) of ``kvfuzz campaign``'s options a scheduler campaign does not take."""

SCHEDULER_ONLY = (
    "batch_examples",
    "batch_seconds",
    "no_shrink",
    "isolate",
    "untested_engine",
)
"""The attributes of ``kvfuzz campaign``'s options only a scheduler campaign takes."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvfuzz.option_defaults import SCHEDULER_NAMES

    group = parser.add_argument_group("scheduler campaign (with --scheduler; docs/scheduler-campaigns.md)")
    group.add_argument(
        "--batch-examples",
        type=_at_least_one,
        metavar="N",
        help="examples per configuration drawn from the swarm table (default 25)",
    )
    group.add_argument(
        "--batch-seconds",
        type=positive_seconds,
        metavar="S",
        help="the most a batch's search runs before the next configuration is drawn (default: a twentieth of "
        "--duration, at least 10; none without --duration)",
    )
    group.add_argument("--no-shrink", action="store_true", default=None, help="save failures as found, unshrunk")
    group.add_argument(
        "--untested-engine",
        action="store_true",
        default=None,
        help="run on an engine version kvfuzz is not tested on (refused otherwise; docs/scheduler.md, Versions)",
    )
    group.add_argument(
        "--isolate",
        action="store_true",
        default=None,
        help="run each batch in a child process: a crash or a hang of the engine kills the child, not the campaign",
    )
    parser.add_argument(
        "--scheduler",
        choices=SCHEDULER_NAMES,
        help="instead of allocators, a real engine scheduler, its configuration swarmed per batch",
    )


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def usage_error(args: argparse.Namespace) -> Optional[str]:
    """The one line a ``kvfuzz campaign`` with these arguments is refused with, if any."""
    if args.scheduler is None:
        given = [name for name in SCHEDULER_ONLY if getattr(args, name) is not None]
        return f"--{given[0].replace('_', '-')} needs --scheduler" if given else None
    if args.allocator:
        return "--scheduler and --allocator exclude each other"
    for attribute, default, what in ALLOCATOR_ONLY:
        if getattr(args, attribute) != default:
            return f"--scheduler does not take {what}"
    if args.workers is not None:
        from kvfuzz.commands.options import workers_problem

        problem = workers_problem(args.workers)
        if problem is not None:
            return problem
    corpus = Path(args.corpus)
    if corpus.exists() and not corpus.is_dir():
        return f"--corpus {args.corpus}: not a directory"
    for path in args.known or ():
        if not Path(path).is_dir():
            return f"--known {path}: not a directory"
    measured = args.coverage or args.guided or args.coverage_html is not None
    if measured and args.isolate:
        return "--coverage, --guided and --coverage-html measure in the worker process: they exclude --isolate"
    problem = coverage_html_problem(args.coverage_html)
    if problem is not None:
        return problem
    from kvfuzz.swarm_table import PinRefused, parse_pins

    try:
        parse_pins(args.pin or (), swarm_table(args.scheduler))
    except PinRefused as refused:
        return str(refused)
    if args.database is not None:
        from kvfuzz.campaign.cluster import check_redis_url, is_redis

        if not is_redis(args.database):
            return (
                f"--database {args.database}: a scheduler campaign stores its findings in a Redis only "
                "(redis://HOST:PORT/N); without one they are in --corpus"
            )
        try:
            check_redis_url(args.database)
        except ValueError as error:
            return str(error)
    from kvfuzz.scheduler.engines import engine_problem

    return engine_problem(args.scheduler, bool(args.untested_engine))


def scheduler_campaign(args: argparse.Namespace, emit_json: Callable[[Any], None], target: Any = None) -> int:
    """Exit status: 2 for bad input (or a corpus another campaign holds), 130 on Ctrl-C, 3 for a harness error, 1
    for a new failure, else 0. ``target`` replaces the real scheduler (tests without vLLM)."""
    from kvfuzz.campaign.lock import CorpusInUse
    from kvfuzz.campaign.report import new_finding_lines, table
    from kvfuzz.campaign.scheduler.loop import BATCH_EXAMPLES, SchedulerCampaignOptions, default_batch_seconds
    from kvfuzz.campaign.scheduler.workers import SchedulerCampaign
    from kvfuzz.campaign.supervisor import DEFAULT_DURATION, Supervisor
    from kvfuzz.scheduler.swarm import NothingValid, draw
    from kvfuzz.swarm_table import PinRefused, describe_pins, parse_pins

    real = target is None
    problem = usage_error(args) if real else None
    if problem is not None:
        print(f"kvfuzz: {problem}", file=sys.stderr)
        return 2
    if target is None:
        target = scheduler_target(args.scheduler)
    try:
        pins = parse_pins(args.pin or (), target.dimensions)
    except PinRefused as refused:
        print(f"kvfuzz: {refused}", file=sys.stderr)
        return 2
    if args.no_known:
        known: list[Path] = []
    elif args.known:
        known = [Path(path) for path in args.known]
    else:
        known = [Path("corpus")] if Path("corpus").is_dir() else []
    duration = args.duration if args.duration is not None else (None if args.max_examples else DEFAULT_DURATION)
    options = SchedulerCampaignOptions(
        args.scheduler,
        args.seed if args.seed is not None else random.SystemRandom().randrange(2**32),
        Path(args.corpus),
        duration=duration,
        max_examples=args.max_examples,
        stop_after=args.stop_after,
        batch_examples=args.batch_examples or BATCH_EXAMPLES,
        known=tuple(known),
        shrink=not args.no_shrink,
        isolate=bool(args.isolate),
        call_timeout=args.call_timeout or None,
        pins=pins,
        database=args.database,
        workers=args.workers or 1,
        coverage=bool(args.coverage or args.guided or args.coverage_html is not None),
        guided=bool(args.guided),
        batch_seconds=args.batch_seconds if args.batch_seconds is not None else default_batch_seconds(duration),
    )
    from kvfuzz.scheduler.engines import untested_warning

    warning = untested_warning(args.scheduler) if real else None  # the real engine's, not a test's
    try:  # pins no configuration the engine accepts goes with: refused before any batch runs
        draw(random.Random(options.seed), target.validate, target.dimensions, dict(pins))
    except NothingValid as nothing:
        print(
            f"kvfuzz: --pin {describe_pins(pins)}: no configuration with these pins is valid: {nothing}",
            file=sys.stderr,
        )
        return 2
    pinned = f", pinned: {describe_pins(options.pins)}" if options.pins else ""
    capped = f" (at most {options.batch_seconds:g} s)" if options.batch_seconds is not None else ""
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    if not args.json:
        ends = " or ".join(
            part
            for part in (
                f"{duration:g} s" if duration else None,
                plural(args.max_examples, "example") if args.max_examples else None,
                plural(args.stop_after, "new failure") if args.stop_after else None,
            )
            if part
        )
        print(
            f"kvfuzz campaign: --scheduler {args.scheduler}\n  {plural(options.workers, 'worker')}, until {ends}, "
            f"seed {options.seed}; each batch of "
            f"{plural(options.batch_examples, 'example')}{capped} draws the engine's configuration from the swarm "
            f"table (kvfuzz/scheduler/swarm.py){pinned}{', in a child process' if options.isolate else ''}\n  new "
            f"failures saved to {options.corpus}; known findings from: {', '.join(map(str, known)) or 'none'} and "
            "the corpus"
            + (
                "\n  coverage-guided: programs reaching new coverage kept as seeds and mutated"
                if options.guided
                else ""
            )
            + ("\n  the engine's coverage measured" if options.coverage and not options.guided else ""),
            flush=True,
        )
    status = (lambda line: print(f"  {line}", file=sys.stderr, flush=True)) if not args.json else None
    event = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        supervisor = Supervisor(SchedulerCampaign(options, target), status, event)
    except CorpusInUse as error:
        print(f"kvfuzz: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"kvfuzz: --corpus {args.corpus}: cannot write its campaign state ({error})", file=sys.stderr)
        return 2
    result = supervisor.run()
    if args.json:
        emit_json(result.to_json())
    else:
        print("\n".join(table(result)))
        preemptions = sum(batch["preemptions"] for batch in result.batch_log)
        hits = sum(batch["hit_tokens"] for batch in result.batch_log)
        print(
            f"{plural(result.batches, 'configuration')} drawn (kvfuzz/scheduler/swarm.py{pinned}), "
            f"{result.refused} more refused by vLLM's validation and redrawn; the scheduler preempted "
            f"{plural(preemptions, 'request')}, {plural(hits, 'prompt token')} hit the prefix cache"
        )
        if result.new:
            print("\n".join(new_finding_lines(result.new)))
    title = f"kvfuzz campaign --scheduler {args.scheduler}, seed {options.seed}"
    write_coverage_report(args.coverage_html, result, title)
    if result.ended_by == "interrupted":
        return 130
    if result.ended_by == "harness error":
        from kvfuzz.scheduler.harness import HARNESS_STATUS

        return HARNESS_STATUS
    return 1 if result.new else 0


def swarm_table(name: str) -> tuple[Dimension, ...]:
    """The swarm table of ``--scheduler NAME``, read without importing its engine (so a pin is checked first)."""
    if name == "sglang":
        from kvfuzz.scheduler.sglang.swarm import SGLANG_DIMENSIONS

        return SGLANG_DIMENSIONS
    from kvfuzz.scheduler.swarm import DIMENSIONS

    return DIMENSIONS


def scheduler_target(name: str) -> SchedulerTarget:
    """The scheduler ``--scheduler NAME`` runs (its engine imported on first use)."""
    if name == "sglang":
        from kvfuzz.campaign.scheduler.sglang_target import sglang_target

        return sglang_target(name)
    from kvfuzz.campaign.scheduler.target import vllm_target

    return vllm_target(name)
