"""``kvfuzz run --scheduler sglang``: the Hypothesis machine against SGLang's scheduling loop, every check on, and
its outcome printed (or one JSON object). A failure is saved to ``--corpus`` as a scheduler trace (scheduler
``sglang``): the first failing example the moment it fails, the shrunk one when the search ends."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from kvfuzz.program.safeguards import Watchdog
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.sglang.build import setup_problem
from kvfuzz.text import plural

if TYPE_CHECKING:
    from hypothesis.database import ExampleDatabase

__all__ = ["run_sglang", "setup_problem"]


def run_sglang(
    args: argparse.Namespace,
    setup: SchedulerSetup,
    emit_json: Callable[[Any], None],
    database: Optional[ExampleDatabase] = None,
) -> int:
    """Run the search (with ``database``, random and kept there: ``--database``); exit status 0 (passed) or 1 (a
    check failed, or SGLang raised)."""
    from kvfuzz.scheduler.engines import SGLANG, untested_warning
    from kvfuzz.scheduler.replay import bounded_replay
    from kvfuzz.scheduler.search import search, search_kind
    from kvfuzz.scheduler.sglang.build import sglang
    from kvfuzz.scheduler.sglang.session import SGLangSession
    from kvfuzz.scheduler.sglang.traces import SGLangFailureRecorder
    from kvfuzz.scheduler.shrinking import shrink_drifted
    from kvfuzz.trace_saving import NO_TRACE_FIELDS

    started = time.perf_counter()
    sglang()
    imported = time.perf_counter() - started
    warning = untested_warning("sglang")
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    if not args.json:
        print(
            f"kvfuzz run: --scheduler sglang (SGLang {SGLANG.installed()}'s SchedulePolicy, PrefillAdder and "
            f"ScheduleBatch over its UnifiedRadixCache, in kvfuzz's copy of the Scheduler's loop; SGLang imported in "
            f"{imported:.1f} s)\n  "
            f"{setup.describe()}\n  {plural(args.examples, 'example')} of up to "
            f"{plural(args.steps, 'operation')}, {search_kind(args.seed, args.database)}; "
            + (f"a step running past {args.call_timeout:g} s is a hang" if args.call_timeout else "no watchdog"),
            flush=True,
        )
    recorder = SGLangFailureRecorder("sglang", Path(args.corpus))
    with Watchdog(args.call_timeout) if args.call_timeout else contextlib.nullcontext() as watchdog:
        outcome = search(
            setup,
            examples=args.examples,
            steps=args.steps,
            shrink=not args.no_shrink,
            witness=recorder,
            session=lambda: SGLangSession(setup, watchdog=watchdog),
            name="SGLangSchedulerMachine",
            seed=args.seed,
            database=database,
        )
    if not args.json:
        print("\n".join(outcome.describe()).replace("the scheduler preempted", "the scheduler retracted"), flush=True)
    if outcome.harness is not None:  # kvfuzz's own code failed: its traceback and hint, nothing saved
        from kvfuzz.scheduler.harness import HARNESS_STATUS

        print(outcome.harness.describe(), file=sys.stderr, flush=True)
        if args.json:
            emit_json({"scheduler": "sglang", "seed": args.seed, **outcome.to_json()})
        return HARNESS_STATUS
    saved = recorder.finish(outcome.failure, shrunk=not args.no_shrink)
    if args.json:
        if saved is not None and saved.error is not None:
            print(f"kvfuzz: trace NOT saved: cannot write {saved.path} ({saved.error})", file=sys.stderr)
        emit_json(
            {
                "scheduler": "sglang",
                "seed": args.seed,
                "configure_seconds": round(imported, 3),
                **outcome.to_json(),
                **(NO_TRACE_FIELDS if saved is None else saved.json_fields()),
            }
        )
    elif saved is not None:
        print(f"\n{saved.report()}")
    call_timeout = args.call_timeout or None
    drifted = shrink_drifted(recorder.first, saved, lambda trace: bounded_replay(trace, call_timeout))
    if drifted is not None:
        print(drifted, file=sys.stderr, flush=True)
    return 1 if outcome.failure is not None else 0
