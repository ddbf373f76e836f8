"""``kvfuzz run --scheduler sglang``: the Hypothesis machine against SGLang's scheduling loop, every check on, and
its outcome printed (or one JSON object). A failure's shrunk program is printed; it is not saved as a scheduler trace
yet (docs/scheduler.md)."""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Optional

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.text import plural


def setup_problem(setup: SchedulerSetup) -> Optional[str]:
    """The one line a configuration SGLang's paged pool cannot serve is refused with."""
    if setup.block_size < 2:
        return "--scheduler sglang needs --block-size >= 2 (SGLang serves page size 1 with another allocator)"
    return None


def run_sglang(args: argparse.Namespace, setup: SchedulerSetup, emit_json: Callable[[Any], None]) -> int:
    """Run the search; exit status 0 (passed) or 1 (a check failed, or SGLang raised)."""
    from kvfuzz.scheduler.search import search
    from kvfuzz.scheduler.sglang.build import sglang
    from kvfuzz.scheduler.sglang.session import SGLangSession

    started = time.perf_counter()
    sglang()
    imported = time.perf_counter() - started
    if not args.json:
        print(
            f"kvfuzz run: --scheduler sglang (SGLang's SchedulePolicy, PrefillAdder and ScheduleBatch over its "
            f"UnifiedRadixCache, in kvfuzz's copy of the Scheduler's loop; SGLang imported in {imported:.1f} s)\n  "
            f"{setup.describe()}\n  {plural(args.examples, 'example')} of up to "
            f"{plural(args.steps, 'operation')}, derandomized",
            flush=True,
        )
    outcome = search(
        setup,
        examples=args.examples,
        steps=args.steps,
        shrink=not args.no_shrink,
        session=lambda: SGLangSession(setup),
        name="SGLangSchedulerMachine",
    )
    if args.json:
        emit_json({"scheduler": "sglang", "configure_seconds": round(imported, 3), **outcome.to_json()})
    else:
        print("\n".join(outcome.describe()).replace("the scheduler preempted", "the scheduler retracted"), flush=True)
    return 1 if outcome.failure is not None else 0
