"""``kvfuzz run --scheduler NAME --isolate``: the examples in a child process forked from the command (vLLM already
imported), so that a crash that kills the process (a segfault in a native extension, an abort) or a hang no interrupt
reaches loses nothing: the child keeps the running example's program in a journal, and the command turns it into a
trace whose failure is ``crash (SchedulerProcessDied)``, as an isolated scheduler campaign does
(:mod:`kvfuzz.campaign.scheduler.isolated`, on :mod:`kvfuzz.isolation`). A child that returns reports as a run
without ``--isolate`` would."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from kvfuzz.campaign.scheduler.isolated import died_trace, journal_target, run_watched
from kvfuzz.commands.scheduler_campaign import scheduler_target
from kvfuzz.isolation import Returned
from kvfuzz.program.safeguards import journal_path
from kvfuzz.scheduler.command import Body, Ran
from kvfuzz.scheduler.recorder import save_scheduler_trace
from kvfuzz.scheduler.trace import PROCESS_DIED, SchedulerTrace
from kvfuzz.trace_saving import NO_TRACE_FIELDS


def run_isolated(body: Body, args: argparse.Namespace) -> Ran:
    """``body`` in a child (see the module): what it returned, or its death as a finding (exit status 1), or 130
    when Ctrl-C ended the run (the child is killed; a failure it had found is already saved by it)."""
    corpus = Path(args.corpus)
    corpus.mkdir(parents=True, exist_ok=True)
    journal = journal_path(corpus)
    header = journal_target(args.scheduler, scheduler_target(args.scheduler).version())
    try:
        ended = run_watched(body, journal, header, args.call_timeout or None)
        if isinstance(ended, Returned):
            ran: Ran = ended.value
            return ran
        message = f"the process running the examples {ended.told()}"
        trace = died_trace(journal, message)
        return _report_death(args, trace, message, corpus)
    except KeyboardInterrupt:
        print("kvfuzz: interrupted; the isolated examples were stopped", flush=True)
        return Ran(130, {"scheduler": args.scheduler, "failed": False, "interrupted": True} if args.json else None)
    finally:
        journal.unlink(missing_ok=True)


def _report_death(args: argparse.Namespace, trace: Optional[SchedulerTrace], message: str, corpus: Path) -> Ran:
    saved = save_scheduler_trace(trace, corpus) if trace is not None else None
    lost = "" if saved is not None else "; its program is lost (no journal)"
    if args.json:
        return Ran(
            1,
            {
                "scheduler": args.scheduler,
                "seed": args.seed,
                "failed": True,
                "check": "crash",
                "explanation": f"crash: {PROCESS_DIED}: {message}{lost}",
                **(NO_TRACE_FIELDS if saved is None else saved.json_fields()),
            },
        )
    print(f"FAILED: crash: {PROCESS_DIED}: {message}{lost}", flush=True)
    if saved is not None:
        print(f"not shrunk (every replay would kill the process)\n\n{saved.report()}", flush=True)
    return Ran(1)
