"""vLLM's real v1 Scheduler in the loop (kvfuzz.scheduler, docs/scheduler.md): the unmodified scheduler passes, and
each check is shown catching a seeded bug, with the message it names.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there): without vLLM 0.33.0 the import
fails loudly rather than skipping."""

from __future__ import annotations

import json
import re
from typing import Any, Iterator

import pytest
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm_versions import V1_RUNNER, v2_alone

from kvfuzz.cli import main
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.fake_model import expected_output
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.violations import Check, SchedulerViolation
from kvfuzz.scheduler.worker import Worker

SMALL = SchedulerSetup(num_blocks=8)  # a pool small enough that the scheduler preempts
PREFIX = [1, 2, 3, 0, 2, 2, 1, 3]  # two full blocks of 4


def finish(session: Session, prompt: list[int], max_tokens: int) -> str:
    """Add a request and step until it has finished."""
    request = session.add(prompt, max_tokens)
    while request in session.outputs.unfinished():
        session.step()
    return request


def test_the_unmodified_scheduler_passes_and_reaches_preemption_and_hits() -> None:
    outcome = search(SMALL, examples=25, steps=30)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0 and outcome.hit_tokens > 0, outcome.describe()


def test_the_v1_model_runner_s_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    """With vLLM's V1 model runner the scheduler resumes a preempted request among the cached ones, with a table
    that replaces the old; the worker follows (VLLM_USE_V2_MODEL_RUNNER is read each time the config is asked)."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    if not V1_RUNNER:  # vLLM 0.34.0 removed Model Runner V1: asking for it gets V2's protocol
        return v2_alone(SMALL)
    assert not Worker(SMALL).runner_v2
    outcome = search(SMALL, examples=15, steps=30)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0, outcome.describe()


def test_without_prefix_caching_and_with_a_token_budget_of_one_block() -> None:
    setup = SchedulerSetup(num_blocks=8, max_num_batched_tokens=4, max_num_seqs=2, prefix_caching=False)
    outcome = search(setup, examples=15, steps=30)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.hit_tokens == 0


def test_outputs_are_the_fake_model_s_tokens() -> None:
    """A request alone: its output is the fake model's tokens for it, every block free once it finished."""
    session = Session(SMALL)
    request = finish(session, PREFIX + [1], 5)
    assert session.outputs.requests[request].received == expected_output(request, 9, 5)
    session.drain()
    pool = session.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == SMALL.num_blocks and session.worker.requests == {}


def preempted_at(policy: str) -> list[tuple[int, list[str]]]:
    """A request of priority 1 then one of priority 0 that cannot both fit: the steps that preempted, and whom."""
    session = Session(SchedulerSetup(num_blocks=8, policy=policy))
    low = session.add([1, 2, 3, 0] * 3, 14, priority=1)
    high = session.add([3, 3, 2, 1] * 2, 10, priority=0)
    preempted = []
    while session.outputs.unfinished():
        before = session.preemptions
        session.step()
        if session.preemptions > before:
            held = session.scheduler.requests
            preempted.append((session.steps, [r for r in (low, high) if held[r].status.name == "PREEMPTED"]))
    session.drain()
    return preempted


def test_the_policy_decides_whom_vllm_preempts() -> None:
    """FCFS preempts the request admitted last (r1); the priority policy the one of the lowest priority (r0, of
    priority 1), although it came first: the configuration's policy reaches vLLM, and each request its priority."""
    assert preempted_at("fcfs") == [(7, ["r1"])]
    assert preempted_at("priority") == [(7, ["r0"])]


def test_the_priority_policy_passes_and_reaches_preemption_and_hits() -> None:
    outcome = search(SchedulerSetup(num_blocks=8, policy="priority"), examples=25, steps=30)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0 and outcome.hit_tokens > 0, outcome.describe()


class HitBlindWorker(Worker):
    """A worker whose slot mapping ignores a new request's prefix hit: its suffix is written over the start of the
    shared cached blocks (the write-path bug the issue names)."""

    def consume(self, output: Any, step: int) -> None:
        super().consume(output, step)
        self.hits = {new.req_id for new in output.scheduled_new_reqs if new.num_computed_tokens}

    def slots(self, request: str, positions: range, step: int, group: int = 0) -> list[int]:
        if request in self.hits:
            positions = range(len(positions))
        return super().slots(request, positions, step, group)


def test_exclusivity_catches_a_suffix_written_over_the_shared_cached_blocks() -> None:
    session = Session(SMALL, HitBlindWorker)
    finish(session, PREFIX + [1], 2)
    session.add(PREFIX + [3, 3], 2)
    with pytest.raises(SchedulerViolation) as caught:
        session.step()
    assert caught.value.check is Check.EXCLUSIVE
    assert caught.value.cause == "over its own computed K/V", caught.value  # the suffix over its own cached prefix
    assert re.search(
        r"exclusive check failed at step \d+, request r1: its position 8 \(tag 0x[0-9a-f]+\) is written to block \d+, "
        r"slot \d+, which request r1 relies on for its position 0 \(tag 0x[0-9a-f]+\); the slot holds tag "
        r"0x[0-9a-f]+, written at step 1",
        str(caught.value),
    ), caught.value


def test_content_catches_a_prefix_hit_on_another_prefix_s_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager's hit hands over, for the second block of a prefix, a cached block of another prefix: nothing is
    overwritten (refcounts and free count stay consistent), but what the request attends to is not its own."""
    original = KVCacheManager.get_computed_blocks

    def get_computed_blocks(self: KVCacheManager, request: Any, *args: Any, **kwargs: Any) -> Any:
        found = original(self, request, *args, **kwargs)
        blocks = found[0]
        hits = blocks.blocks[0]
        if len(hits) >= 2:
            pool = self.block_pool
            hits[1] = next(
                block
                for block in pool.free_block_queue.get_all_free_blocks()
                if block.block_hash is not None and block not in hits
            )
        return found

    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", get_computed_blocks)
    session = Session(SMALL)
    finish(session, PREFIX + [1], 2)
    finish(session, [3, 3, 3, 3, 0], 2)
    session.add(PREFIX + [3], 2)
    with pytest.raises(SchedulerViolation) as caught:
        session.step()
    assert caught.value.check is Check.CONTENT
    assert caught.value.cause == "a cache hit on other content", caught.value
    assert re.search(
        r"content check failed at step \d+, request r2: position 4 \(block \d+, slot \d+\) should hold the K/V of the "
        r"request's own tokens \[1, 2, 3, 0, 2\] \(tag 0x[0-9a-f]+\), but holds the K/V of request r1's position 0",
        str(caught.value),
    ), caught.value


@pytest.fixture
def double_allocation(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A block pool that hands out a block still in use (refcount and free count kept consistent, so only the
    content can tell)."""
    original = BlockPool.get_new_blocks

    def get_new_blocks(self: BlockPool, num_blocks: int) -> list[Any]:
        blocks = original(self, num_blocks)
        taken = {block.block_id for block in blocks}
        in_use = [
            block
            for block in self.blocks[1:]
            if block.ref_cnt > 0 and block.block_id not in taken and not block.block_hash
        ]
        if blocks and in_use:
            self.free_blocks([blocks[0]])
            in_use[0].ref_cnt += 1
            blocks[0] = in_use[0]
        return blocks

    monkeypatch.setattr(BlockPool, "get_new_blocks", get_new_blocks)
    yield


@pytest.mark.usefixtures("double_allocation")
def test_exclusivity_catches_a_block_handed_out_while_in_use_from_random_requests() -> None:
    outcome = search(SchedulerSetup(num_blocks=8, prefix_caching=False), examples=50, steps=30)
    assert outcome.check() == "exclusive", outcome.describe()
    assert isinstance(outcome.failure, SchedulerViolation) and outcome.failure.cause in (
        "a block another request holds at another position",
        "two writes to one slot in a step",
        "a shared cached prefix block",
    ), outcome.failure.cause
    assert re.search(r"which request r\d+ (relies on|wrote this step) for its position \d+", outcome.explanation()), (
        outcome.describe()
    )
    assert "state.add_request(" in outcome.program and "state.step()" in outcome.program


def test_accounting_catches_a_block_lost_on_free(monkeypatch: pytest.MonkeyPatch) -> None:
    original = BlockPool.free_blocks
    armed = [True]

    def free_blocks(self: BlockPool, ordered_blocks: Any) -> None:
        blocks = list(ordered_blocks)
        if armed[0] and blocks:
            armed[0] = False
            blocks.pop().ref_cnt -= 1  # neither freed nor held any more
        original(self, blocks)

    monkeypatch.setattr(BlockPool, "free_blocks", free_blocks)
    session = Session(SMALL)
    finish(session, PREFIX + [1], 2)
    with pytest.raises(SchedulerViolation) as caught:
        session.drain()
    assert caught.value.check is Check.ACCOUNTING
    assert re.search(
        r"accounting check failed at step \d+: the manager reports 7 free blocks, but the running requests' tables "
        r"hold 0 distinct blocks of 8, so 8 must be free; blocks neither free nor in a table: \[\d+\]",
        str(caught.value),
    ), caught.value


def test_accounting_catches_a_block_id_dropped_from_the_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler allocates two blocks for a prompt but tells the worker of one."""
    original = KVCacheBlocks.get_block_ids
    armed = [True]

    def get_block_ids(self: KVCacheBlocks, allow_none: bool = False, **kwargs: Any) -> Any:
        ids = original(self, allow_none, **kwargs)
        if armed[0] and ids is not None and len(ids[0]) >= 2:
            armed[0] = False
            return (ids[0][:-1],)
        return ids

    monkeypatch.setattr(KVCacheBlocks, "get_block_ids", get_block_ids)
    session = Session(SMALL)
    session.add(PREFIX + [1], 2)
    with pytest.raises(SchedulerViolation) as caught:
        session.step()
    assert caught.value.check is Check.ACCOUNTING
    assert re.search(
        r"accounting check failed at step 1, request r0: the manager reports 5 free blocks, but the running "
        r"requests' tables hold 2 distinct blocks of 8, so 6 must be free; blocks neither free nor in a table: "
        r"\[(\d+)\]; block \1 in vLLM's own table for r0 \(RUNNING, 9 computed, in vLLM's running queue\)$",
        str(caught.value),
    ), caught.value


def test_the_batch_check_catches_tokens_scheduled_beyond_the_request_s_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's output schedules a block's worth of tokens more than the blocks it gave the request cover
    (the total kept consistent): the model runner's slot mapping would index past the block table."""
    original = Scheduler.schedule
    armed = [True]

    def schedule(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        if armed[0] and output.scheduled_new_reqs:
            armed[0] = False
            request = output.scheduled_new_reqs[0].req_id
            output.num_scheduled_tokens[request] += SMALL.block_size
            output.total_num_scheduled_tokens += SMALL.block_size
        return output

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    session = Session(SMALL)
    session.add(PREFIX + [1], 2)
    with pytest.raises(SchedulerViolation) as caught:
        session.step()
    assert caught.value.check is Check.BATCH
    assert re.fullmatch(
        r"batch check failed at step 1, request r0: the step schedules its positions 0\.\.12, but its block table of "
        r"3 block\(s\) \[\d+, \d+, \d+\] covers positions 0\.\.11 only",
        str(caught.value),
    ), caught.value


def test_the_batch_check_catches_a_running_request_the_output_forgets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The output schedules tokens for a running request but leaves it out of the cached requests: the model
    runner would have no row for it."""
    original = Scheduler.schedule

    def schedule(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        cached = output.scheduled_cached_reqs
        if cached.req_ids:
            output.scheduled_cached_reqs = type(cached).make_empty()
        return output

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    session = Session(SMALL)
    session.add(PREFIX + [1], 2)
    session.step()
    with pytest.raises(SchedulerViolation) as caught:
        session.step()
    assert caught.value.check is Check.BATCH
    assert str(caught.value) == (
        "batch check failed at step 2, request r0: the step schedules 1 token(s) for it, but the output brings it "
        "neither as a new nor as a cached request, so the model runner has no table for it; new [], cached []"
    ), caught.value


def test_accounting_catches_a_hit_not_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix hit that does not take a reference: the shared blocks' refcount is one short of the tables."""
    monkeypatch.setattr(BlockPool, "touch", lambda self, blocks: None)
    session = Session(SMALL)
    first = session.add(PREFIX + [1], 4)
    session.step()
    session.add(PREFIX + [3], 2)
    with pytest.raises(SchedulerViolation) as caught:
        session.step()
    assert caught.value.check is Check.ACCOUNTING
    assert re.search(
        rf"block \d+ is held by the tables of 2 running request\(s\) \['{first}', 'r1'\] \(expected ref_cnt 2, not "
        r"free\), but the manager's block (has ref_cnt 1|is in the free queue)",
        str(caught.value),
    ), caught.value


def test_outputs_catch_a_token_lost_from_a_request_s_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler keeps the token in the request but loses it from the output it reports."""
    original = Scheduler._update_request_with_output
    calls = [0]

    def update(self: Scheduler, request: Any, new_token_ids: list[int], is_stale: bool = False) -> Any:
        tokens, stopped = original(self, request, new_token_ids, is_stale)
        calls[0] += 1
        return ([] if calls[0] == 2 else tokens), stopped

    monkeypatch.setattr(Scheduler, "_update_request_with_output", update)
    session = Session(SMALL)
    session.add(PREFIX + [1], 4)
    with pytest.raises(SchedulerViolation) as caught:
        session.drain()
    assert caught.value.check is Check.OUTPUTS and caught.value.cause == "a token lost", caught.value
    assert expected_output("r0", 9, 4) == [1, 3, 0, 3]  # token #1 (3) lost, so #2 (0) is reported as #1
    assert "request r0: output token #1 is 0, but the fake model sampled 3" in str(caught.value), caught.value


class TokenLosingWorker(Worker):
    """A model runner that loses the request's second sampled token: the scheduler waits for it forever."""

    def sampled(self, request: str, position: int) -> list[int]:
        return [] if len(self.history[request]) == 1 else super().sampled(request, position)


def test_progress_catches_a_request_that_never_finishes() -> None:
    session = Session(SMALL, TokenLosingWorker)
    session.add(PREFIX + [1], 4)
    with pytest.raises(SchedulerViolation) as caught:
        session.drain()
    assert caught.value.check is Check.PROGRESS
    assert re.search(
        r"progress check failed at step \d+, request r0: .*r0 \(RUNNING, 10 computed, 1 of 4 output tokens\)",
        str(caught.value),
    ), caught.value


def test_the_cli_runs_the_target_and_refuses_what_vllm_refuses_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--scheduler", "vllm-v1", "--examples", "5", "--num-blocks", "8", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["scheduler"] == "vllm-v1" and summary["failed"] is False and summary["steps"] > 0
    assert main(["run", "--scheduler", "vllm-v1", "--policy", "priority", "--examples", "5", "--num-blocks", "8"]) == 0
    assert "8 blocks x 4 slots, token budget 16, at most 4 running, prefix caching on, priority scheduling" in (
        capsys.readouterr().out
    )
    assert main(["run", "--scheduler", "vllm-v1", "--max-num-batched-tokens", "3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "kvfuzz: max_num_batched_tokens (3) must be greater than or equal to max_num_seqs (4)."
    ]


def test_an_exception_of_vllm_s_own_is_a_finding_with_its_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM asserting in ``schedule()`` once a request is preempted: reported as a crash, shrunk to its program."""

    def preempt(self: Scheduler, request: Any, *args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"seeded: preempting {request.request_id}")

    monkeypatch.setattr(Scheduler, "_preempt_request", preempt)
    outcome = search(SMALL, examples=50, steps=30)
    assert outcome.check() == "crash", outcome.describe()
    assert outcome.explanation().startswith("crash: AssertionError: seeded: preempting r")
    assert "state.add_request(" in outcome.program
