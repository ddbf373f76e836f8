"""Speculative decoding in vLLM's real v1 Scheduler (scheduler.speculative, docs/scheduler-async.md): the unmodified
scheduler passes with k = 1, 2 and 4 drafts, drafts are both accepted and rejected, the scheduler's computed tokens
roll back, a rejected draft's slot is rewritten, and each seeded bug is caught with the message it names.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there)."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

import attrs
import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm_versions import V1_RUNNER, v2_alone

from kvfuzz.cli import main
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.fake_model import expected_output, sampled_token
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.speculative import Verified, accepted, proposal
from kvfuzz.scheduler.trace import load
from kvfuzz.scheduler.violations import Check, SchedulerViolation
from kvfuzz.scheduler.vllm_build import vllm_config
from kvfuzz.scheduler.worker import Worker

PROMPT = [1, 2, 3, 0, 2, 2, 1]


def drafted(k: int, num_blocks: int = 16) -> SchedulerSetup:
    return SchedulerSetup(num_blocks=num_blocks, speculative_tokens=k)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_unmodified_scheduler_passes_with_k_drafts_accepted_and_rejected(k: int) -> None:
    outcome = search(drafted(k, num_blocks=8), examples=12, steps=30)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0 and outcome.hit_tokens > 0, outcome.describe()
    assert 0 < outcome.accepted_drafts < outcome.drafts, outcome.describe()
    assert f"speculative drafts scheduled: {outcome.accepted_drafts} accepted" in "\n".join(outcome.describe())


def test_the_v1_model_runner_s_protocol_with_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    if not V1_RUNNER:  # vLLM 0.34.0 removed Model Runner V1: asking for it gets V2's protocol
        return v2_alone(drafted(2, num_blocks=8))
    outcome = search(drafted(2, num_blocks=8), examples=10, steps=30)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0 and 0 < outcome.accepted_drafts < outcome.drafts, outcome.describe()


def test_a_rejection_rolls_back_and_its_slot_is_rewritten_by_the_bonus_token() -> None:
    """A request alone: the step that verifies its drafts accepts the first and rejects the second; the scheduler's
    computed tokens roll back to the accepted one, the rejected draft's block stays the request's (accounted), and
    the next step writes the bonus token over the rejected draft's slot."""
    k = 4
    session = Session(drafted(k))
    request = session.add(PROMPT, 40)
    for _ in range(40):  # until the drafts proposed after a step are one accepted, then one rejected
        session.step()
        position, drafts = session.worker.speculation.proposed.get(request, (0, []))
        if len(drafts) >= 2 and accepted(request, position, drafts) == 1:
            break
    else:
        raise AssertionError("the drafter never rejected the second draft of a proposal")
    assert len(session.worker.requests[request].tokens) == position
    assert drafts == proposal(request, position, k)
    session.step()  # verifies the drafts: one accepted, the next rejected
    state = session.worker.requests[request]
    assert state.tokens[position:] == [sampled_token(request, position), sampled_token(request, position + 1)]
    held = session.scheduler.requests[request]
    assert held.num_computed_tokens == position + 1 == state.computed  # rolled back over the rejected drafts
    rejected_slot = session.worker.slots(request, range(position + 1, position + 2), session.steps)[0]
    written = session.worker.kv.shadow[rejected_slot]
    assert written is not None and written.draft and written.position == position + 1
    blocks = len(state.table)
    session.step()
    assert len(state.table) >= blocks  # the rejected drafts' blocks stay in its table (the accounting check passed)
    rewritten = session.worker.kv.shadow[rejected_slot]
    assert rewritten is not None and not rewritten.draft and rewritten.step == session.steps
    session.drain()
    assert session.outputs.requests[request].received == expected_output(request, len(PROMPT), 40)


def not_rolling_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeded bug: ``update_from_output`` keeps every scheduled draft computed, rejected ones included."""
    original = Scheduler.update_from_output

    def update_from_output(self: Scheduler, scheduler_output: Any, model_runner_output: Any) -> Any:
        before = {
            request: self.requests[request].num_computed_tokens
            for request in scheduler_output.scheduled_spec_decode_tokens
            if request in self.requests
        }
        outputs = original(self, scheduler_output, model_runner_output)
        for request, computed in before.items():
            held = self.requests.get(request)
            if held is not None and not held.is_finished():
                held.num_computed_tokens = computed
        return outputs

    monkeypatch.setattr(Scheduler, "update_from_output", update_from_output)


def test_the_speculative_check_catches_a_scheduler_that_does_not_roll_back(monkeypatch: pytest.MonkeyPatch) -> None:
    not_rolling_back(monkeypatch)
    outcome = search(drafted(2), examples=50, steps=30, shrink=False)
    assert isinstance(outcome.failure, SchedulerViolation) and outcome.failure.check is Check.SPECULATIVE, (
        outcome.describe()
    )
    assert re.fullmatch(
        r"speculative check failed at step \d+, request r\d+: the scheduler counts (\d+) computed tokens, but its "
        r"last step verified drafts \[[0-9, -]+\] \(\d+ accepted, [1-9]\d* rejected\), after which "
        r"(?:positions 0\.\.\d+ hold|position 0 holds) valid K/V: "
        r"(?:positions \d+\.\.\d+ hold|position \d+ holds) rejected drafts' K/V, so they must be recomputed",
        str(outcome.failure),
    ), outcome.failure


class RollbackBlindWorker(Worker):
    """A worker without the speculative check of the rollback, to show that the content check alone also keeps a
    request from attending to a rejected draft's K/V."""

    def __init__(self, setup: SchedulerSetup) -> None:
        super().__init__(setup)
        self.speculation.check_computed = lambda request, computed, step: None  # type: ignore[method-assign]


def test_content_catches_a_request_attending_to_its_rejected_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    not_rolling_back(monkeypatch)
    outcome = search(drafted(2), examples=50, steps=30, shrink=False, worker=RollbackBlindWorker)
    assert isinstance(outcome.failure, SchedulerViolation) and outcome.failure.check is Check.CONTENT, (
        outcome.describe()
    )
    assert re.search(
        r"content check failed at step \d+, request (r\d+): position \d+ \(block \d+, slot \d+\) should hold the K/V "
        r"of the request's own tokens \[[0-9, ]+\] \(tag 0x[0-9a-f]+\), but holds the K/V of request \1's draft at "
        r"position \d+ \(tag 0x[0-9a-f]+\), written at step \d+",
        str(outcome.failure),
    ), outcome.failure


def test_accounting_catches_a_scheduler_that_frees_the_blocks_of_rejected_drafts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The seeded bug: after the rollback, ``update_from_output`` frees the blocks that only rejected drafts used,
    which the model runner's table still holds (no protocol tells it to shrink a table): the accounting check, when
    the block is free, or (as the derandomized search first finds it) once the same request is handed it again."""
    frees_rejected_drafts_blocks(monkeypatch)
    outcome = search(drafted(4), examples=50, steps=30, shrink=False)
    assert isinstance(outcome.failure, SchedulerViolation) and outcome.failure.check is Check.ACCOUNTING, (
        outcome.describe()
    )
    assert re.search(
        r"accounting check failed at step \d+, request (r\d+): block \d+ is held by the tables of \d running "
        r"request\(s\) \['\1'.*\] \(expected ref_cnt \d, not free\), but the manager's block (is in the free queue|has "
        r"ref_cnt \d)",
        str(outcome.failure),
    ), outcome.failure


def frees_rejected_drafts_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeded bug: after the rollback, ``update_from_output`` frees the blocks only rejected drafts used."""
    original = Scheduler.update_from_output

    def update_from_output(self: Scheduler, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = original(self, scheduler_output, model_runner_output)
        manager = self.kv_cache_manager
        for request in scheduler_output.scheduled_spec_decode_tokens:
            held = self.requests.get(request)
            if held is None or held.is_finished():
                continue
            blocks = manager.coordinator.single_type_managers[0].req_to_blocks[request]
            needed = -(-(held.num_computed_tokens + 1) // self.block_size)
            if len(blocks) > needed:
                manager.block_pool.free_blocks(reversed(blocks[needed:]))
                del blocks[needed:]
        return outputs

    monkeypatch.setattr(Scheduler, "update_from_output", update_from_output)


class RejectedDraftInOutputWorker(Worker):
    """The seeded bug: the model runner returns every scheduled draft, rejected ones included, then the bonus."""

    def verified_tokens(self, request: str, known: int, verified: Verified) -> list[int]:
        bonus = self.sampled(request, known + verified.accepted)
        return [draft for draft in verified.drafts if draft >= 0] + bonus


def test_outputs_catch_a_rejected_draft_in_the_output() -> None:
    outcome = search(drafted(2), examples=50, steps=30, shrink=False, worker=RejectedDraftInOutputWorker)
    assert isinstance(outcome.failure, SchedulerViolation) and outcome.failure.check is Check.OUTPUTS, (
        outcome.describe()
    )
    assert re.search(r"output token #\d+ is \d, but the fake model sampled \d", str(outcome.failure)), outcome.failure


def test_without_speculation_a_scheduled_draft_is_refused() -> None:
    """Drafts the worker never proposed (speculative decoding off) are a failure, not written as known tokens."""
    session = Session(SchedulerSetup())
    session.add(PROMPT, 4)
    session.step()
    session.scheduler.requests["r0"].spec_token_ids = [1, 2]
    with pytest.raises(SchedulerViolation) as caught:
        session.step()
    assert caught.value.check is Check.SPECULATIVE
    assert str(caught.value).startswith(
        "speculative check failed at step 2, request r0: scheduled with drafts [1, 2], but speculative decoding is off"
    )


def test_the_cli_runs_records_and_replays_with_drafts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--scheduler", "vllm-v1", "--speculative-tokens", "3", "--examples", "5", "--json"]) == 0
    passed = json.loads(capsys.readouterr().out)
    assert passed["failed"] is False and passed["drafts"] > passed["accepted_drafts"] > 0

    not_rolling_back(monkeypatch)
    corpus = tmp_path / "corpus"
    status = main(
        ["run", "--scheduler", "vllm-v1", "--speculative-tokens", "2", "--no-shrink", "--corpus", str(corpus)]
    )
    out = capsys.readouterr().out
    assert status == 1 and "2 speculative draft(s)" in out, out
    (path,) = corpus.glob("vllm-v1-speculative-*.json")
    trace = load(path)
    assert trace.setup.speculative_tokens == 2 and json.loads(path.read_text())["config"]["speculative_tokens"] == 2
    again = replay(trace)
    assert again.reproduced and again.identical, again.describe_failure()
    monkeypatch.undo()
    assert not replay(trace).failed


def test_a_bad_speculative_option_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--scheduler", "vllm-v1", "--speculative-tokens", "-1"]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "kvfuzz: speculative_tokens must be >= 0, got -1\n")


def async_drafted(k: int, num_blocks: int = 8, drafter: str = "ngram") -> SchedulerSetup:
    return SchedulerSetup(num_blocks=num_blocks, speculative_tokens=k, async_scheduling=True, drafter=drafter)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_unmodified_async_scheduler_passes_with_k_drafts(k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts under async scheduling, the V2 model runner's protocol: placeholders filled by the worker's own drafts,
    accepted and rejected, with preemptions and prefix hits."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    outcome = search(async_drafted(k), examples=12, steps=30)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0 and outcome.hit_tokens > 0, outcome.describe()
    assert 0 < outcome.accepted_drafts < outcome.drafts, outcome.describe()


def test_drafts_under_async_on_the_v1_runner_are_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM 0.33.0 refuses n-gram drafts under async on its V1 model runner; kvfuzz plays drafts under async only on
    V2 (0.34.0 has no V1 runner: the same command runs there)."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    command = ["run", "--scheduler", "vllm-v1", "--speculative-tokens", "2", "--async-scheduling", "--examples", "2"]
    if not V1_RUNNER:
        assert main(command) == 0
        return
    assert main(command) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err.splitlines()) == (
        "",
        ["kvfuzz: Async scheduling is not supported by the V1 model runner with ngram-based speculative decoding."],
    ) or captured.err == (
        "kvfuzz: speculative decoding under async scheduling is driven with vLLM's V2 model runner only: the V1 "
        "runner refuses n-gram drafts under async, and kvfuzz's worker plays only V2's protocol for them\n"
    ), captured


def test_under_async_the_scheduler_gets_placeholders_and_the_worker_fills_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Step 2 is scheduled while step 1 is in flight: its drafts are -1 placeholders on top of step 1's optimistic
    count, the engine core never hands the scheduler drafts (``post_step`` does only when synchronous), and the
    worker verifies the drafts it proposed after step 1 in their place; after step 1's output returns, the
    scheduler's count is rolled back by step 1's rejections and the worker's own count plus step 2's."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    session = Session(async_drafted(2, num_blocks=16))
    request = session.add(PROMPT, 12)
    assert type(session.scheduler) is AsyncScheduler
    assert "not self.async_scheduling" in inspect.getsource(EngineCore.post_step)
    session.step()  # step 1 launched (the prompt), in flight
    position, drafts = session.worker.speculation.proposed[request]
    assert position == len(PROMPT) + 1 and drafts == proposal(request, position, 2)
    session.step()  # step 2 launched on step 1's placeholder, then step 1 returned
    (batch,) = session.loop.batches
    assert batch.output.scheduled_spec_decode_tokens == {request: [-1, -1]}
    own = drafts[:2] + [-1] * (2 - len(drafts[:2]))
    assert session.worker.speculation.scheduled[request] == own
    held, state = session.scheduler.requests[request], session.worker.requests[request]
    rejected = 2 - accepted(request, position, own)
    assert held.num_computed_tokens == state.computed + rejected  # step 2's rejections still counted
    session.drain()
    assert session.outputs.requests[request].received == expected_output(request, len(PROMPT), 12)


def not_rolling_back_under_async(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeded bug: the ``AsyncScheduler``'s ``update_from_output`` rolls back neither the computed tokens nor the
    output placeholders of rejected drafts (as if every output were stale)."""
    original = Scheduler.update_from_output

    def update_from_output(self: Scheduler, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = original(self, scheduler_output, model_runner_output)
        for request, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            held = self.requests.get(request)
            index = model_runner_output.req_ids.index(request) if request in model_runner_output.req_ids else None
            if held is None or held.is_finished() or index is None or not held.num_output_placeholders:
                continue
            rejected = len(drafts) - (len(model_runner_output.sampled_token_ids[index]) - 1)
            held.num_computed_tokens += rejected
            held.num_output_placeholders += rejected
        return outputs

    monkeypatch.setattr(Scheduler, "update_from_output", update_from_output)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")


def test_under_async_the_speculative_check_catches_a_scheduler_that_does_not_roll_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    not_rolling_back_under_async(monkeypatch)
    outcome = search(async_drafted(2), examples=50, steps=30, shrink=False)
    assert isinstance(outcome.failure, SchedulerViolation) and outcome.failure.check is Check.SPECULATIVE, (
        outcome.describe()
    )
    assert re.fullmatch(
        r"speculative check failed at step \d+, request r\d+: the scheduler counts (\d+) computed tokens, but "
        r"(?:positions 0\.\.\d+ hold|position 0 holds) valid K/V and (?:the \d+ draft\(s\) of it rejected by step\(s\) "
        r"\[\d+\], in flight|no draft of it rejected in a step in flight): it should count \d+",
        str(outcome.failure),
    ), outcome.failure
    assert outcome.failure.cause == "rejected drafts not rolled back"


def test_under_async_outputs_catch_placeholders_counted_for_k_drafts_not_those_scheduled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The seeded bug: the ``AsyncScheduler`` counts ``1 + k`` output placeholders for every decode it schedules
    (``num_spec_tokens``), not one for the sample and one per draft it scheduled, so a decode scheduled with fewer
    drafts (the step that ends a prefill, one trimmed by the budget) counts outputs no step will sample."""
    original = AsyncScheduler._update_after_schedule

    def update_after_schedule(self: AsyncScheduler, scheduler_output: Any) -> None:
        original(self, scheduler_output)
        for request in scheduler_output.num_scheduled_tokens:
            held = self.requests[request]
            if not held.is_prefill_chunk:
                drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(request, ()))
                held.num_output_placeholders += self.num_spec_tokens - drafts

    monkeypatch.setattr(AsyncScheduler, "_update_after_schedule", update_after_schedule)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    outcome = search(async_drafted(2), examples=50, steps=30, shrink=False)
    assert isinstance(outcome.failure, SchedulerViolation) and outcome.failure.check is Check.OUTPUTS, (
        outcome.describe()
    )
    assert re.fullmatch(
        r"outputs check failed at step \d+, request r\d+: the scheduler counts (\d+) output tokens, but the fake "
        r"model sampled \d+( and steps in flight rejected \d+ draft\(s\) it still counts)?",
        str(outcome.failure),
    ), outcome.failure


def test_under_async_accounting_catches_a_scheduler_that_frees_the_blocks_of_rejected_drafts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The seeded bug of the synchronous test above, under async: the blocks only rejected drafts used are freed
    while the runner's table (and the next step, in flight) still holds them."""
    frees_rejected_drafts_blocks(monkeypatch)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    outcome = search(async_drafted(4, num_blocks=16), examples=50, steps=30, shrink=False)
    assert isinstance(outcome.failure, SchedulerViolation) and outcome.failure.check is Check.ACCOUNTING, (
        outcome.describe()
    )


def ignoring_draft_slots(monkeypatch: pytest.MonkeyPatch, setup: SchedulerSetup) -> None:
    """The seeded bug: ``schedule()`` reads no draft slots (``max_num_new_slots_for_drafting`` 0), so a step's input
    runs past ``max_num_batched_tokens`` by the slots a draft model appends to each request."""
    spec_class = type(vllm_config(setup).speculative_config)
    slots = spec_class.max_num_new_slots_for_drafting
    original = Scheduler.schedule

    def schedule(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
        spec_class.max_num_new_slots_for_drafting = property(lambda spec: 0)
        try:
            return original(self, *args, **kwargs)
        finally:
            spec_class.max_num_new_slots_for_drafting = slots

    monkeypatch.setattr(Scheduler, "schedule", schedule)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_budget_check_catches_a_scheduler_that_ignores_a_draft_model_s_slots(
    monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    setup = SchedulerSetup(
        num_blocks=16,
        max_num_batched_tokens=8,
        speculative_tokens=2,
        drafter="draft-model",
        async_scheduling=async_scheduling,
    )
    assert search(setup, examples=8, steps=30).failure is None
    ignoring_draft_slots(monkeypatch, setup)
    outcome = search(setup, examples=50, steps=30, shrink=False)
    assert isinstance(outcome.failure, SchedulerViolation) and outcome.failure.check is Check.BUDGET, outcome.describe()
    assert re.fullmatch(
        r"budget check failed at step \d+, request r\d+: the step's input is (\d+) slots \(\d+ scheduled tokens \(.*\) "
        r"and 1 draft slot\(s\) for each of its \d+ requests\), but max_num_batched_tokens is 8",
        str(outcome.failure),
    ), outcome.failure


def test_the_parallel_drafter_runs_on_0_33_s_v1_runner_and_is_refused_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PARD (a parallel draft model, k draft slots a request) exists in vLLM 0.33.0 on its V1 model runner (V2 does
    not support parallel drafting); 0.34.0 refuses it (``parallel_drafting`` only for dflash and dspark)."""
    setup = SchedulerSetup(num_blocks=8, max_num_batched_tokens=16, speculative_tokens=3, drafter="parallel")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    refused = "parallel drafter|Model Runner V2 does not yet support: parallel drafting|parallel_drafting is only"
    with pytest.raises(ValueError, match=refused):
        vllm_config(setup)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    if not V1_RUNNER:
        with pytest.raises(ValueError, match="parallel_drafting is only supported by the dflash and dspark"):
            vllm_config(setup)
        return
    assert vllm_config(setup).speculative_config.max_num_new_slots_for_drafting == 3
    outcome = search(setup, examples=10, steps=30)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert 0 < outcome.accepted_drafts < outcome.drafts, outcome.describe()


HANG = Path(__file__).parent.parent / "corpus" / "vllm-v1-scheduler-speculative-padding-hang-6123748f32e9.json"


def test_more_drafts_than_the_token_budget_hang_a_request_whose_prompt_hits_all_but_one_token() -> None:
    """A finding in vLLM 0.33.0 as released (docs/scheduler-async.md): with k + 1 drafts and bonus more than the step's
    token budget, the scheduler pads a waiting request with one token left to compute to 1 + k tokens, which never
    fit, and stops admitting: the progress check, replayed word for word from the corpus; with k + 1 within the
    budget the same program passes."""
    trace = load(HANG)
    assert trace.known_bug and trace.setup.speculative_tokens + 1 > trace.setup.max_num_batched_tokens
    found = replay(trace)
    assert found.reproduced and found.identical, found.describe_failure()
    assert found.describe_failure() == (
        "progress check failed at step 2, request r1: the step scheduled nothing while 1 request(s) are unfinished: "
        "r1 (WAITING, 0 computed, 0 of 1 output tokens)"
    )
    within = attrs.evolve(
        trace, setup=attrs.evolve(trace.setup, speculative_tokens=trace.setup.max_num_batched_tokens - 1)
    )
    assert not replay(within).failed


def test_the_cli_records_and_replays_the_drafter(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--drafter`` runs, is named in the header, recorded in the trace's ``config.drafter`` and replayed."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    options = ["--speculative-tokens", "2", "--drafter", "draft-model", "--max-num-batched-tokens", "8"]
    setup = SchedulerSetup(max_num_batched_tokens=8, speculative_tokens=2, drafter="draft-model")
    ignoring_draft_slots(monkeypatch, setup)
    corpus = tmp_path / "corpus"
    status = main(["run", "--scheduler", "vllm-v1", *options, "--no-shrink", "--corpus", str(corpus)])
    out = capsys.readouterr().out
    assert status == 1 and "2 speculative draft(s) (draft-model drafter)" in out, out
    (path,) = corpus.glob("vllm-v1-*.json")
    trace = load(path)
    assert trace.setup.drafter == "draft-model" and json.loads(path.read_text())["config"]["drafter"] == "draft-model"
    again = replay(trace)
    assert again.reproduced and again.identical, again.describe_failure()
    monkeypatch.undo()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert not replay(trace).failed


def test_a_drafter_without_drafts_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--scheduler", "vllm-v1", "--drafter", "draft-model"]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == (
        "",
        "kvfuzz: drafter draft-model needs speculative decoding (speculative_tokens >= 1)\n",
    )
