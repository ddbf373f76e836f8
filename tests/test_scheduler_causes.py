"""What the scheduler target's content, exclusive, outputs and released checks know of a failure's cause, fed
directly (no vLLM): each cause a check names, from the state that produces it. The cause is what a campaign's
signature tells two failures of one check apart by (kvfuzz.campaign.scheduler.target.scheduler_signature); the
seeded bugs of engine_tests/test_vllm_scheduler.py check the causes the real scheduler's bugs get."""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

import pytest
from factories import async_worker

from kvfuzz.scheduler.async_batches import BatchQueue
from kvfuzz.scheduler.ending import Ending
from kvfuzz.scheduler.fake_model import expected_output
from kvfuzz.scheduler.kv_slots import Claim, SlotPool
from kvfuzz.scheduler.lora import check_loras
from kvfuzz.scheduler.outputs import OutputLedger
from kvfuzz.scheduler.requests import request_namespace
from kvfuzz.scheduler.signature import scheduler_signature
from kvfuzz.scheduler.violations import Check, SchedulerViolation

A = [5, 6, 7, 8]
B = [9, 9, 9, 9]
SLOTS = [0, 1, 2, 3]  # block 0, block size 4


def caught(check: Check, act: Callable[[], None]) -> Optional[str]:
    with pytest.raises(SchedulerViolation) as raised:
        act()
    assert raised.value.check is check, raised.value
    return raised.value.cause


# -- content -------------------------------------------------------------------------------------------------------


def written(
    request: str, tokens: list[int], slots: list[int], step: int = 1, drafts_from: Optional[int] = None
) -> SlotPool:
    pool = SlotPool(16, 4)
    pool.write(request, tokens, range(len(tokens)), slots, step, pool.claims(), drafts_from=drafts_from)
    return pool


def test_content_a_cache_hit_on_other_content() -> None:
    pool = written("r0", B, SLOTS)
    assert caught(Check.CONTENT, lambda: pool.check("r1", A, SLOTS, 2, hit=4)) == "a cache hit on other content"


def test_content_a_cache_hit_on_unwritten_content() -> None:
    pool = SlotPool(16, 4)
    assert caught(Check.CONTENT, lambda: pool.check("r1", A, SLOTS, 2, hit=4)) == "a cache hit on unwritten content"


def test_content_its_write_went_to_another_slot() -> None:
    pool = written("r0", B, SLOTS)
    pool.write("r1", A, range(4), [4, 5, 6, 7], 2, pool.claims())  # its K/V in block 1, its table says block 0
    assert caught(Check.CONTENT, lambda: pool.check("r1", A, SLOTS, 2)) == "its write went to another slot"


def test_content_unwritten_content() -> None:
    pool = SlotPool(16, 4)
    assert caught(Check.CONTENT, lambda: pool.check("r1", A, SLOTS, 2)) == "unwritten content"


def test_content_a_draft_s_k_v() -> None:
    pool = written("r1", [5, 6, 7, 1], SLOTS, drafts_from=3)  # position 3 drafted as 1; 8 was verified
    assert caught(Check.CONTENT, lambda: pool.check("r1", A, SLOTS, 2)) == "a draft's K/V"


def test_content_its_own_k_v_of_another_position() -> None:
    pool = SlotPool(16, 4)
    pool.write("r1", A[:1], range(1), [0], 1, pool.claims())
    pool.write("r1", A[:2], range(1, 2), [0], 2, pool.claims())  # position 1 over position 0, whose K/V is nowhere now
    assert caught(Check.CONTENT, lambda: pool.check("r1", A[:1], [0], 3)) == "its own K/V of another position"


def test_content_stale_content_of_another_request() -> None:
    pool = written("r0", B, SLOTS)
    assert caught(Check.CONTENT, lambda: pool.check("r1", A, SLOTS, 2)) == "stale content of another request"


# -- exclusive -----------------------------------------------------------------------------------------------------


def write_over(claim: Claim, namespace: tuple[str, ...] = ()) -> Optional[str]:
    pool = SlotPool(16, 4)
    taken = pool.claims()
    taken.slots[2] = claim
    return caught(Check.EXCLUSIVE, lambda: pool.write("r1", A, range(4), SLOTS, 2, taken, namespace))


def test_exclusive_two_writes_to_one_slot_in_a_step() -> None:
    assert write_over(Claim("r0", 2, 1, "wrote this step")) == "two writes to one slot in a step"


def test_exclusive_over_its_own_computed_k_v() -> None:
    assert write_over(Claim("r1", 0, 1, "relies on")) == "over its own computed K/V"


def test_exclusive_a_block_another_request_holds_at_another_position() -> None:
    assert write_over(Claim("r0", 6, 1, "relies on")) == "a block another request holds at another position"


def test_exclusive_a_shared_cached_prefix_block() -> None:
    assert write_over(Claim("r0", 2, 1, "relies on")) == "a shared cached prefix block"


def test_exclusive_a_block_shared_across_cache_salts() -> None:
    claim = Claim("r0", 2, 1, "relies on", ("salt-a",))
    assert write_over(claim, ("salt-b",)) == "a block shared across cache salts"


def test_exclusive_a_block_shared_across_lora_adapters() -> None:
    """The adapter decides before the salt: a block shared across adapters, salted alike or not."""
    claim = Claim("r0", 2, 1, "relies on", request_namespace("a", 1))
    assert write_over(claim, request_namespace("a", 2)) == "a block shared across LoRA adapters"
    assert write_over(Claim("r0", 2, 1, "relies on", request_namespace(None, 1))) == (
        "a block shared across LoRA adapters"
    )
    assert write_over(claim, request_namespace("b", 1)) == "a block shared across cache salts"


def test_the_content_check_names_the_salt_and_the_adapter() -> None:
    pool = SlotPool(16, 4)
    pool.write("r0", A, range(4), SLOTS, 1, pool.claims(), request_namespace("a", 1))
    with pytest.raises(SchedulerViolation) as failed:
        pool.check("r1", A, SLOTS, 2, request_namespace("a", 2), hit=4)
    assert "under cache salt 'a' under LoRA adapter lora2 (tag " in str(failed.value)
    assert "request r0's position 0 under cache salt 'a' under LoRA adapter lora1 (tag " in str(failed.value)
    assert failed.value.cause == "a cache hit on other content"


# -- LoRA ------------------------------------------------------------------------------------------------------------


def test_lora_more_adapters_in_a_step_than_max_loras() -> None:
    adapters = {"r0": 1, "r1": 2, "r2": 0, "r3": 3}
    with pytest.raises(SchedulerViolation) as failed:
        check_loras(adapters, adapters, adapters, 2, 4)
    assert str(failed.value) == (
        "lora check failed at step 4, request r3: the step schedules requests of 3 distinct LoRA adapters "
        "(lora1: r0; lora2: r1; lora3: r3), but max_loras is 2"
    )
    assert failed.value.cause == "more adapters in a step than max_loras"
    check_loras(adapters, adapters, adapters, 3, 4)  # three adapters (and r2 without one) fit max_loras 3


def test_lora_a_request_run_under_another_adapter() -> None:
    assert caught(Check.LORA, lambda: check_loras(["r0"], {"r0": 0}, {"r0": 2}, 2, 1)) == (
        "a request run under another adapter"
    )
    with pytest.raises(SchedulerViolation) as failed:
        check_loras(["r0"], {"r0": 1}, {"r0": 2}, 2, 1)
    assert str(failed.value) == (
        "lora check failed at step 1, request r0: the model runner is told to run it under LoRA adapter lora1, but "
        "its client asked for LoRA adapter lora2"
    )


# -- outputs -------------------------------------------------------------------------------------------------------


def ledger(stop: tuple[int, ...] = (), max_tokens: int = 6) -> tuple[OutputLedger, list[int]]:
    """Request r2 with a 4-token prompt, whose outputs begin 0, 1, 2, 3 (the fake model's tokens differ there)."""
    outputs = OutputLedger()
    outputs.added("r2", 4, max_tokens, Ending(stop))
    sampled = expected_output("r2", 4, max_tokens + 4)
    assert sampled[:4] == [0, 1, 2, 3]
    return outputs, sampled


@pytest.mark.parametrize(
    "received, cause",
    [
        ([0, 2, 3], "a token lost"),
        ([0, 1, 1, 2], "a token repeated"),
        ([0, 2, 1], "tokens out of order"),
        ([0, 3], "a token other than the one sampled"),
    ],
)
def test_outputs_a_wrong_token_is_told_by_how_the_rest_lines_up(received: list[int], cause: str) -> None:
    outputs, sampled = ledger()
    assert caught(Check.OUTPUTS, lambda: outputs.record("r2", received, False, 1)) == cause


def test_outputs_a_stop_token_the_sampler_masks_before_min_tokens() -> None:
    """r2's outputs begin 0, 1, 2, 3: with 1 a stop token and min_tokens 3, the sampler never samples 1 at #1."""
    outputs = OutputLedger()
    outputs.added("r2", 4, 6, Ending((1,), min_tokens=3))
    assert caught(Check.OUTPUTS, lambda: outputs.record("r2", [0, 1], False, 1)) == "a stop token before min_tokens"


def test_outputs_a_token_past_max_tokens_and_after_a_stop_token() -> None:
    outputs, sampled = ledger(max_tokens=2)
    assert caught(Check.OUTPUTS, lambda: outputs.record("r2", sampled[:3], False, 1)) == "a token past max_tokens"
    stop = sampled[1]
    first = sampled.index(stop)
    outputs, sampled = ledger(stop=(stop,))
    past = sampled[: first + 2]
    assert caught(Check.OUTPUTS, lambda: outputs.record("r2", past, False, 1)) == "a token after a stop token"


def test_outputs_finished_early_and_a_token_after_the_finish() -> None:
    outputs, sampled = ledger()
    assert caught(Check.OUTPUTS, lambda: outputs.record("r2", sampled[:2], True, 1)) == "finished early"
    outputs, sampled = ledger(max_tokens=2)
    outputs.record("r2", sampled[:2], True, 1)
    after = caught(Check.OUTPUTS, lambda: outputs.record("r2", [sampled[2]], False, 2))
    assert after == "a token after the request finished"


# -- released (async scheduling) -------------------------------------------------------------------------------------


def worker(tables: dict[str, list[int]], live: tuple[str, ...], preempted: tuple[str, ...] = ()) -> Any:
    return async_worker(tables, {request: 0 for request in tables}, live, preempted)


def released(second: Any, writer: str = "r1") -> Optional[str]:
    """Step 1 reads block 5 for r0 (in flight); step 2 writes ``writer``'s prompt into block 5, r0 no longer holding
    it; nothing orders the write after the read."""
    queue = BatchQueue()
    queue.ordered = lambda reader, step: False  # type: ignore[method-assign]
    queue.before_execute(types.SimpleNamespace(num_scheduled_tokens={"r0": 3}), worker({"r0": [5]}, ("r0",)), 1)
    return caught(
        Check.RELEASED, lambda: queue.before_execute(types.SimpleNamespace(num_scheduled_tokens={writer: 2}), second, 2)
    )


def test_released_a_block_of_a_finished_request() -> None:
    assert released(worker({"r1": [5]}, ("r1",))) == "a block of a finished or dropped request"


def test_released_a_preempted_request_s_block() -> None:
    second = worker({"r1": [5], "r0": [5]}, ("r1",), preempted=("r0",))
    assert released(second) == "a preempted request's block"


def test_released_a_block_the_writer_itself_released() -> None:
    assert released(worker({"r0": [5]}, ()), writer="r0") == "a block the writer itself released"


# -- signatures ------------------------------------------------------------------------------------------------------


def test_two_causes_of_one_check_are_two_signatures() -> None:
    one = SchedulerViolation(Check.CONTENT, 3, "r1", "...", "a cache hit on other content")
    two = SchedulerViolation(Check.CONTENT, 5, "r2", "...", "its write went to another slot")
    again = SchedulerViolation(Check.CONTENT, 9, "r4", "other text", "a cache hit on other content")
    assert scheduler_signature("vllm-v1", one).key() != scheduler_signature("vllm-v1", two).key()
    assert scheduler_signature("vllm-v1", one).key() == scheduler_signature("vllm-v1", again).key()
    assert str(scheduler_signature("vllm-v1", one)).endswith("content: a cache hit on other content")
