"""The pytest plugin's search of a scheduler target (``pytest --kvfuzz-scheduler vllm-v1``): what
``kvfuzz run --scheduler NAME`` does at its default configuration, with the examples, steps and seed of the session's
profile, or, under the nightly profile, what ``kvfuzz campaign --scheduler NAME`` does. The item itself lives in
:mod:`kvfuzz.pytest_plugin`; this module runs the search and says, for a person, what failed (None: nothing)."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Optional

import attrs


@attrs.frozen
class SchedulerSearch:
    """One scheduler search as the session's options ask for it."""

    scheduler: str  # a key of kvfuzz.scheduler.command.SCHEDULERS
    examples: int
    steps: int
    seed: Optional[int]  # None: derandomized (the ci profile)
    corpus: Path  # where a failure's trace is saved
    call_timeout: Optional[float]  # a step running longer is a hang (None: no watchdog)


def engine_missing(scheduler: str) -> Optional[str]:
    """Why ``scheduler``'s engine cannot run here (None: it is installed), in one line, with what to do."""
    if scheduler == "sglang":
        from kvfuzz.scheduler.sglang.build import sglang_missing

        missing, engine = sglang_missing(), "SGLang"
    else:
        from kvfuzz.scheduler.vllm_build import vllm_missing

        missing, engine = vllm_missing(), "vLLM"
    if not missing:
        return None
    recipe = "sglang" if scheduler == "sglang" else "vllm"
    return (
        f"--kvfuzz-scheduler {scheduler} needs {engine}, which is not installed here; build its environment with "
        f"scripts/third_party_env.sh {recipe}"
    )


def search_scheduler(search: SchedulerSearch) -> Optional[str]:
    """Run the search; the failure (its check, the shrunk program, the explanation and where its trace is), or
    None when every example passed."""
    from kvfuzz.program.safeguards import Watchdog
    from kvfuzz.scheduler.config import SchedulerSetup
    from kvfuzz.scheduler.recorder import FailureRecorder
    from kvfuzz.scheduler.search import search as run_search

    setup = SchedulerSetup()
    with Watchdog(search.call_timeout) if search.call_timeout else contextlib.nullcontext() as watchdog:
        if search.scheduler == "sglang":
            from kvfuzz.scheduler.sglang.session import SGLangSession
            from kvfuzz.scheduler.sglang.traces import SGLangFailureRecorder

            recorder: FailureRecorder = SGLangFailureRecorder("sglang", search.corpus)
            outcome = run_search(
                setup,
                examples=search.examples,
                steps=search.steps,
                witness=recorder,
                session=lambda: SGLangSession(setup, watchdog=watchdog),
                name="SGLangSchedulerMachine",
                seed=search.seed,
            )
        else:
            recorder = FailureRecorder(search.scheduler, search.corpus)
            outcome = run_search(
                setup,
                examples=search.examples,
                steps=search.steps,
                witness=recorder,
                seed=search.seed,
                call_timeout=search.call_timeout,
            )
    if outcome.harness is not None:
        return outcome.harness.describe()
    if outcome.failure is None:
        return None
    saved = recorder.finish(outcome.failure, shrunk=True)
    where = f"\n\n{saved.report()}" if saved is not None else ""
    return "\n".join(outcome.describe()) + where


def campaign_scheduler(
    scheduler: str, corpus: Path, duration: float, seed: Optional[int], database: Optional[str]
) -> Optional[str]:
    """The nightly profile: a scheduler campaign of ``duration`` seconds, the corpus's findings known; the table of
    new distinct failures (None: none), or of the campaign's errors."""
    from kvfuzz.campaign.report import table
    from kvfuzz.campaign.scheduler.loop import SchedulerCampaignOptions
    from kvfuzz.campaign.scheduler.workers import run_scheduler_campaign
    from kvfuzz.commands.scheduler_campaign import scheduler_target

    options = SchedulerCampaignOptions(
        scheduler,
        seed if seed is not None else random.SystemRandom().randrange(2**32),
        corpus,
        duration=duration,
        known=(corpus,),
        database=database,
    )
    result = run_scheduler_campaign(options, scheduler_target(scheduler))
    if result.new or result.errors:
        return "\n".join(table(result))
    return None
