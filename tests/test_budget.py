"""The token-budget scheduler: chunked prefill within the budget, the two policies, the declared cost model's
modelled seconds, and preemptions and timeouts kept as samples, with every invariant still checked."""

from __future__ import annotations

import pytest

from kvfuzz.allocator.paged import paged_allocator
from kvfuzz.engine.config import MachineConfig
from kvfuzz.registry import load_factory
from kvfuzz.workload.budget import BudgetScheduler, Policy
from kvfuzz.workload.cost import CostModel, StepLoad
from kvfuzz.workload.format import FORMAT, parse_workload
from kvfuzz.workload.serving_report import ServingReport


def workload(*requests: dict, name: str = "test") -> object:
    return parse_workload({"format": FORMAT, "name": name, "origin": "constructed", "requests": list(requests)})


def serve(
    trace: object,
    budget: int,
    policy: Policy = Policy.DECODE_FIRST,
    blocks: int = 64,
    allocator: str = "kvfuzz.allocator.paged:paged_allocator",
    **options: object,
) -> ServingReport:
    config = MachineConfig(block_size=4, num_blocks=blocks, num_host_blocks=0)
    scheduler = BudgetScheduler(
        trace, load_factory(allocator)(config.pool_spec()), config, allocator, budget, policy, **options
    )
    return scheduler.serve()


def test_a_long_prompt_is_prefilled_in_chunks_of_the_budget() -> None:
    report = serve(workload({"id": "a", "arrival": 0, "prompt_len": 100, "output_len": 2}), budget=32)
    assert not report.failed, report.replay.failure
    # 100 prompt tokens in chunks of 32, 32, 32, 4: the first token comes from step 3, the second from step 4.
    assert report.steps.time_to_first_token.max == 4
    assert report.steps.end_to_end.max == 5
    assert report.peak_batched_tokens == 32
    assert report.replay.operations["grow"] == 3 + 1  # three more chunks after the admitted one, then one decode


def test_without_a_budget_small_enough_to_bind_the_prompt_is_one_step() -> None:
    report = serve(workload({"id": "a", "arrival": 0, "prompt_len": 100, "output_len": 2}), budget=512)
    assert report.steps.time_to_first_token.max == 1
    assert report.peak_batched_tokens == 100


LONG_PROMPT_DURING_DECODE = (
    {"id": "decoding", "arrival": 0, "prompt_len": 8, "output_len": 20},
    {"id": "long", "arrival": 5, "prompt_len": 200, "output_len": 2},
)


def test_prefill_first_delays_decodes_and_decode_first_does_not() -> None:
    trace = workload(*LONG_PROMPT_DURING_DECODE)
    decode_first = serve(trace, budget=16, policy=Policy.DECODE_FIRST)
    prefill_first = serve(trace, budget=16, policy=Policy.PREFILL_FIRST)
    assert not decode_first.failed and not prefill_first.failed
    # decode-first: the running request decodes every step; the long prompt takes 15 tokens a step: 14 steps.
    # prefill-first: the long prompt takes all 16 a step (13 steps) and the decodes wait for it.
    tpot = {report.policy: report.steps.time_per_output_token.max for report in (decode_first, prefill_first)}
    assert tpot["decode-first"] == 1.0
    assert tpot["prefill-first"] > 1.5
    ttft = {report.policy: report.steps.time_to_first_token.max for report in (decode_first, prefill_first)}
    assert ttft == {"decode-first": 14, "prefill-first": 13}


def test_modelled_seconds_follow_the_declared_cost_model() -> None:
    cost = CostModel(fixed_s=1.0, per_token_s=0.1, per_kv_position_s=0.01)
    report = serve(workload({"id": "a", "arrival": 0, "prompt_len": 10, "output_len": 3}), budget=64, cost=cost)
    # step 0: 10 tokens, 10 positions read; step 1: 1 token, 11 read; step 2: 1 token, 12 read.
    step0, step1, step2 = 1 + 1.0 + 0.10, 1 + 0.1 + 0.11, 1 + 0.1 + 0.12
    seconds = report.seconds
    assert seconds.time_to_first_token.max == pytest.approx(step0)
    assert seconds.end_to_end.max == pytest.approx(step0 + step1 + step2)
    assert seconds.time_per_output_token.max == pytest.approx((step1 + step2) / 2)
    assert report.modelled_seconds == pytest.approx(step0 + step1 + step2)
    assert cost.seconds(StepLoad(0, 10, 10)) == pytest.approx(step0)
    assert "modelled, not measured" in cost.describe()
    assert any("modelled, not measured" in line for line in report.describe())


def test_preemptions_are_kept_as_samples_naming_the_victim_and_the_request_that_needed_room() -> None:
    trace = workload(*({"id": f"r{n}", "arrival": 0, "prompt_len": 6, "output_len": 24} for n in range(4)))
    report = serve(trace, budget=64, blocks=16)
    assert not report.failed, report.replay.failure
    assert report.replay.preemptions > 0
    assert len(report.preemptions) == report.replay.preemptions
    ids = {f"r{n}" for n in range(4)}
    for sample in report.preemptions:
        assert sample.victim in ids and sample.for_request in ids and sample.step >= 0
        assert sample.free_blocks == 0
    text = "\n".join(report.describe())
    assert f"step {report.preemptions[0].step}: {report.preemptions[0].victim} preempted" in text


def test_a_request_not_finished_by_its_deadline_times_out_and_is_kept_as_a_sample() -> None:
    trace = workload(
        {"id": "long", "arrival": 0, "prompt_len": 8, "output_len": 40},
        {"id": "quick", "arrival": 1, "prompt_len": 8, "output_len": 2},
    )
    report = serve(trace, budget=64, timeout_steps=10)
    assert not report.failed, report.replay.failure
    [sample] = report.timeouts
    assert (sample.request, sample.step, sample.arrival, sample.deadline) == ("long", 10, 0, 10)
    assert sample.phase == "running" and sample.produced == 10 and sample.output_len == 40
    assert report.replay.finished == 1
    assert "long (arrived at step 0) timed out after 10 steps while running" in "\n".join(report.describe())


def test_invariants_stay_on_under_the_budget_scheduler() -> None:
    trace = workload(*({"id": f"r{n}", "arrival": n, "prompt_len": 6, "output_len": 8, "samples": 2} for n in range(3)))
    assert not serve(trace, budget=8).failed
    broken = serve(trace, budget=8, allocator="zoo:NoCopyOnWrite")
    assert broken.failed and "invariant" in broken.replay.failure


@pytest.mark.parametrize("policy", list(Policy))
def test_both_policies_serve_a_constructed_workload_with_forks_and_cancellations(policy: Policy) -> None:
    from kvfuzz.workload.constructed import constructed

    config = MachineConfig(block_size=16, num_blocks=48, num_host_blocks=0)
    for name in ("shared-system-prompt", "heavy-cancellation"):
        scheduler = BudgetScheduler(constructed(name), paged_allocator(config.pool_spec()), config, "paged", 24, policy)
        report = scheduler.serve()
        assert not report.failed, report.replay.failure
        assert report.replay.quiescent
        # A step past the budget is a preempted request's readmission running alone: it computes every position
        # it reads (the contract's admit takes all its tokens at once).
        over = [load for load in scheduler.loads if load.batched_tokens > 24]
        assert all(load.batched_tokens == load.kv_positions_read for load in over)
        assert len(over) <= report.replay.operations.get("readmit", 0)
