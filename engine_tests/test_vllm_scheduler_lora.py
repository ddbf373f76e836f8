"""LoRA adapters in the scheduler target (kvfuzz/scheduler/lora.py, docs/scheduler-requests.md#lora): the unmodified
scheduler passes with adapters drawn (its limit reached), an adapter reaches vLLM's prefix cache and its adapter
limit, and each seeded bug is caught (vLLM's block hashing leaving the LoRA out: content; a scheduler ignoring
max_loras: the LoRA check), from hand-written requests with the message, and from random requests with the trace
that replays it.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there): without vLLM 0.33.0 the import
fails loudly rather than skipping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.config import LoRAConfig
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.sched.scheduler import Scheduler

from engine_tests.vllm_seeded_runs import found_and_replayed, run_until_finished
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.violations import Check, SchedulerViolation

LORAS = SchedulerSetup(num_blocks=8, max_loras=2)  # small enough to preempt
PREFIX = [1, 2, 3, 0, 2, 2, 1, 3]  # two full blocks of 4


def drop_lora_from_block_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: vLLM's block hashing leaves the LoRA adapter out of every block's extra keys, so the prefix cache
    shares blocks across adapters."""
    monkeypatch.setattr(kv_cache_utils, "_gen_lora_extra_hash_keys", lambda request: [])


def ignore_max_loras(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the scheduler admits waiting requests of any adapter, whatever ``max_loras`` says (its admission
    test, and its assertion over the running requests, read a limit no step reaches)."""
    original = Scheduler.__init__

    def unlimited(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self.lora_config is not None:
            self.lora_config = LoRAConfig(max_loras=1000, max_lora_rank=self.lora_config.max_lora_rank)

    monkeypatch.setattr(Scheduler, "__init__", unlimited)


def test_the_unmodified_scheduler_passes_with_adapters_drawn() -> None:
    outcome = search(LORAS, examples=25, steps=30)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0 and outcome.hit_tokens > 0, outcome.describe()
    assert outcome.lora_held_back > 0, outcome.describe()  # the limit bit


def test_an_adapter_reaches_vllm_s_prefix_cache() -> None:
    """Equal prompts: a hit under the same adapter (and between requests without one), none across adapters or
    between a request with an adapter and one without."""
    session = Session(SchedulerSetup(max_loras=2))
    hits = []
    for lora in (1, 1, 2, 0, 0):
        before = session.hit_tokens
        run_until_finished(session, session.add(PREFIX + [0], 1, lora=lora))
        hits.append(session.hit_tokens - before)
    assert hits == [0, 8, 0, 0, 8]
    session.drain()


def test_the_adapter_limit_holds_a_third_adapter_back_until_one_finishes() -> None:
    """max_loras 2: requests of adapters 1, 2 and 3 arrive together; the third waits, with room in the pool and the
    budget, until a request of another adapter has finished."""
    session = Session(SchedulerSetup(max_loras=2))
    first, second, third = (session.add([lora], 3, lora=lora) for lora in (1, 2, 3))
    session.step()
    running = {request.request_id for request in session.scheduler.running}
    assert running == {first, second}, running
    assert session.lora_held_back() == 1
    run_until_finished(session, first)
    run_until_finished(session, third)
    session.drain()


def test_a_lora_dropped_from_block_hashes_is_caught_by_the_content_check(monkeypatch: pytest.MonkeyPatch) -> None:
    drop_lora_from_block_hashes(monkeypatch)
    session = Session(SchedulerSetup(max_loras=2))
    run_until_finished(session, session.add(PREFIX + [0], 1, lora=1))
    with pytest.raises(SchedulerViolation) as caught:
        run_until_finished(session, session.add(PREFIX + [0], 1, lora=2))
    violation = caught.value
    assert (violation.check, violation.request) == (Check.CONTENT, "r1"), violation
    assert str(violation).startswith(
        "content check failed at step 2, request r1: position 0 (block 1, slot 4) should hold the K/V of the "
        "request's own tokens [1] under LoRA adapter lora2 (tag "
    ), violation
    assert "but holds the K/V of request r0's position 0 under LoRA adapter lora1" in str(violation), violation
    assert violation.cause == "a cache hit on other content"


def test_a_scheduler_ignoring_max_loras_is_caught_by_the_lora_check(monkeypatch: pytest.MonkeyPatch) -> None:
    ignore_max_loras(monkeypatch)
    session = Session(SchedulerSetup(max_loras=2))
    for lora in (1, 2, 3):
        session.add([lora], 3, lora=lora)
    with pytest.raises(SchedulerViolation) as caught:
        session.step()
    assert str(caught.value) == (
        "lora check failed at step 1, request r2: the step schedules requests of 3 distinct LoRA adapters "
        "(lora1: r0; lora2: r1; lora3: r2), but max_loras is 2"
    )
    assert caught.value.cause == "more adapters in a step than max_loras"


@pytest.mark.parametrize(
    "bug, checks, named",
    [
        # a block shared across adapters is caught by whichever sees it first: a request relying on another
        # adapter's K/V (content), or two requests of different adapters sharing a block one of them writes
        # (exclusive writes)
        (drop_lora_from_block_hashes, {Check.CONTENT, Check.EXCLUSIVE}, "under LoRA adapter"),
        (ignore_max_loras, {Check.LORA}, "but max_loras is 2"),
    ],
)
def test_each_seeded_bug_is_found_from_random_requests_and_its_trace_replays(
    bug: Any,
    checks: set[Check],
    named: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bug(monkeypatch)
    trace = found_and_replayed(capsys, tmp_path / "corpus", ["--max-loras", "2"], checks, named)
    assert trace.setup.max_loras == 2 and any(getattr(op, "lora", 0) for op in trace.program)
    monkeypatch.undo()
    assert replay(trace).failure is None  # passes without the bug
