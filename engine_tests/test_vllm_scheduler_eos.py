"""EOS and min_tokens in the scheduler target (kvfuzz/scheduler/ending.py, docs/scheduler-requests.md): the unmodified
scheduler passes with both drawn; a request ends at the model's EOS token (included in its output) unless it ignores
EOS, and kvfuzz's sampler masks stop tokens and EOS before min_tokens; each is shown catching a seeded bug (the
scheduler's stop check ignoring EOS, or applying it to a request that ignores EOS: outputs; the scheduler's output
bringing the model runner sampling params without the request's min_tokens: outputs), from hand-written requests
with the message, and from random requests with the trace that replays it.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there): without vLLM 0.33.0 the import
fails loudly rather than skipping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core.sched import output as output_module

from engine_tests.vllm_seeded_runs import found_and_replayed, run_until_finished
from engine_tests.vllm_stop_seeds import check_stop_seeing
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.fake_model import EOS_TOKEN
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.violations import Check, SchedulerViolation

BOTH = SchedulerSetup(num_blocks=8, eos=True, min_tokens=True)  # small enough to preempt
PREFIX = [1, 2, 3, 0, 2, 2, 1, 3]  # two full blocks of 4
R0_OUTPUT = [0, 1, 3, 0, 3, 1, 2, 0]  # the fake model's first 8 tokens for r0 after an 8-token prompt (EOS is 3)


def ignore_eos_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the scheduler's stop check never stops at EOS (as if every request ignored it)."""
    check_stop_seeing(monkeypatch, "_eos_token_id", None)


def stop_at_eos_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the scheduler's stop check stops at EOS even for a request that ignores it (ignore_eos)."""
    check_stop_seeing(monkeypatch, "_eos_token_id", EOS_TOKEN)


def drop_min_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the scheduler's output brings the model runner a new request's sampling params without its
    min_tokens, so the sampler does not mask its stop tokens."""
    original = output_module.NewRequestData.from_request.__func__  # type: ignore[attr-defined]

    def without_min_tokens(cls: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        data = original(cls, request, *args, **kwargs)
        if data.sampling_params is not None:
            data.sampling_params = data.sampling_params.clone()
            data.sampling_params.min_tokens = 0
        return data

    monkeypatch.setattr(output_module.NewRequestData, "from_request", classmethod(without_min_tokens))


def output_of(**ending: Any) -> list[int]:
    session = Session(SchedulerSetup())
    request = session.add(PREFIX, 8, **ending)
    run_until_finished(session, request)
    assert session.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 16  # blocks freed
    session.drain()  # the accounting check, quiescent: no table held, every block free
    return session.outputs.requests[request].received


def test_the_unmodified_scheduler_passes_with_eos_and_min_tokens_drawn() -> None:
    outcome = search(BOTH, examples=25, steps=30)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0 and outcome.hit_tokens > 0, outcome.describe()


def test_eos_ends_a_request_with_it_included_unless_ignored() -> None:
    assert output_of(eos=True) == R0_OUTPUT[:3]  # up to the first EOS, included
    assert output_of() == R0_OUTPUT  # ignore_eos: every max_tokens


def test_min_tokens_masks_eos_and_stop_tokens_before_it() -> None:
    # outputs #0..#3 never EOS (3): #2's 3 becomes the next token not a stop token, 0; #4's EOS ends it
    assert output_of(eos=True, min_tokens=4) == [0, 1, 0, 0, 3]
    assert output_of(min_tokens=4) == [0, 1, 0, 0, 3, 1, 2, 0]  # masked even where EOS is ignored, as vLLM masks
    assert output_of(eos=True, stop_token_ids=(1,), min_tokens=2) == [0, 2, 3]  # 1 masked at #1; EOS at #2


def test_the_scheduler_not_stopping_at_eos_is_caught_by_the_outputs_check(monkeypatch: pytest.MonkeyPatch) -> None:
    ignore_eos_always(monkeypatch)
    with pytest.raises(SchedulerViolation) as caught:
        output_of(eos=True)
    assert str(caught.value) == (
        "outputs check failed at step 4, request r0: 4 output tokens [0, 1, 3, 0] reported, but it should have "
        "finished with 3: its output #2, 3, is its first stop token (EOS 3) (expected [0, 1, 3])"
    )


def test_the_scheduler_stopping_at_an_ignored_eos_is_caught_by_the_outputs_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stop_at_eos_always(monkeypatch)
    with pytest.raises(SchedulerViolation) as caught:
        output_of()
    assert str(caught.value) == (
        "outputs check failed at step 3, request r0: finished with 3 output tokens [0, 1, 3], but its max_tokens "
        "is 8, and it ignores EOS (3) (expected [0, 1, 3, 0, 3, 1, 2, 0])"
    )


def test_min_tokens_lost_on_the_way_to_the_sampler_is_caught_by_the_outputs_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    drop_min_tokens(monkeypatch)
    with pytest.raises(SchedulerViolation) as caught:
        output_of(eos=True, min_tokens=4)
    assert str(caught.value) == (
        "outputs check failed at step 3, request r0: output token #2 is 3, but the fake model sampled 0: 3 is a "
        "stop token, which the sampler never samples before min_tokens 4 outputs (the min-tokens processor of the "
        "sampling params the scheduler's output brought) (expected output [0, 1, 0], reported [0, 1, 3]; this step "
        "reported tokens #2..#2)"
    )


@pytest.mark.parametrize(
    "bug, named",
    [
        (ignore_eos_always, "is its first stop token"),
        (stop_at_eos_always, "ignores EOS"),
        (drop_min_tokens, "before min_tokens"),
    ],
)
def test_each_seeded_bug_is_found_from_random_requests_and_its_trace_replays(
    bug: Any,
    named: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bug(monkeypatch)
    trace = found_and_replayed(capsys, tmp_path / "corpus", ["--eos", "--min-tokens"], {Check.OUTPUTS}, named)
    assert trace.setup.eos and trace.setup.min_tokens
    monkeypatch.undo()
    assert replay(trace).failure is None  # passes without the bug
