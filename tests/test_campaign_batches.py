"""A worker's search under a seed is the same whatever its shrinks cost: a random batch ends on its own programs'
calls, so a long shrink of what the batch found neither ends the batch early nor moves the next examples into a
Hypothesis round (whose examples do not repeat under the seed)."""

from __future__ import annotations

import multiprocessing
import queue
import threading
from pathlib import Path

import pytest

from kvfuzz.campaign import worker as worker_module
from kvfuzz.campaign.known import KnownFindings
from kvfuzz.campaign.protocol import Reporter, WorkerContext
from kvfuzz.campaign.swarm import probe_limits
from kvfuzz.campaign.worker import BATCH_STEPS, WorkerPlan, _Worker
from kvfuzz.engine.config import MachineConfig
from kvfuzz.registry import load_factory

ALLOCATOR = "zoo:LeakOnCancel"  # fails in most programs: the batch shrinks several failures


def _search(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, examples: int) -> tuple[list[str], int]:
    """A one-worker search of ``examples`` examples whose every failure 'costs' a shrink of 10 batches' calls:
    the kinds of batches it ran, and how many failures it met."""
    base = MachineConfig()
    plan = WorkerPlan(
        slot=0,
        seed=1,  # meets the leak in each of its first 5 programs
        allocators=(ALLOCATOR,),
        limits=(probe_limits(ALLOCATOR, load_factory(ALLOCATOR), base),),
        base=base,
        corpus=tmp_path / "corpus",
        database=str(tmp_path / "examples"),
        state=tmp_path / "state",
        call_timeout=None,
    )
    batches: list[str] = []
    failures = []

    def shrink_costs_calls(self: _Worker, swarm: object, calls: object, failure: object, safeguards: object) -> None:
        failures.append(failure)
        self.stats.steps += 10 * BATCH_STEPS  # the replays of a long shrink, counted in the worker's stats

    original_batch = _Worker.random_batch

    def random_batch(self: _Worker, swarm: object) -> None:
        batches.append("random")
        original_batch(self, swarm)  # type: ignore[arg-type]

    monkeypatch.setattr(_Worker, "failure", shrink_costs_calls)
    monkeypatch.setattr(_Worker, "random_batch", random_batch)
    monkeypatch.setattr(_Worker, "hypothesis_round", lambda self, swarm: batches.append("hypothesis"))
    budget = multiprocessing.get_context("spawn").Value("q", examples)
    reporter = Reporter(queue.Queue(), 0)  # type: ignore[arg-type]
    stop, halt = threading.Event(), threading.Event()
    known = KnownFindings()
    context = WorkerContext(0, 0, 1, reporter, stop, halt, budget, known, plan.state, plan.state / "claims")  # type: ignore[arg-type]
    _Worker(plan, context).search()
    return batches, len(failures)


def test_a_shrink_does_not_end_the_random_batch_that_found_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    batches, failures = _search(tmp_path, monkeypatch, examples=5)
    assert failures >= 2, "the seed should meet the leak in several of its 5 programs"
    # All 5 examples are of the first batch, a random one: a batch ended by its shrinks' calls would go on to the
    # second batch, a Hypothesis round, and the same seed would then find different things from run to run.
    assert batches == ["random"], batches
    assert worker_module.BATCH >= 5
