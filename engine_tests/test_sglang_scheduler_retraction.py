"""SGLang's retraction under decode memory pressure (docs/sglang.md, "Retraction"): requests that do
not ignore EOS, under a schedule conservativeness below 1, let the PrefillAdder overcommit the pool, and
``retract_decode`` retracts a decoding request; the outputs check holds across it (each request's output is the
fake model's, none lost or repeated, the retracted one resumed after its re-prefill), and two retraction bugs seeded
into SGLang's code are caught: ``reset_for_retract`` discarding the generated output (what SGLang does for an
``input_embeds`` request, applied to every request) and ``retract_decode`` freeing a page of a request it keeps.

The program is directed: random programs rarely retract (the docs give the measured rates), since EOS ends a request
after four tokens on average and only long outputs overrun what the adder reserved. Runs in SGLang's own environment
(``scripts/third_party_env.sh sglang``; CI runs it there)."""

from __future__ import annotations

from array import array
from typing import Any

import pytest
import torch

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.sglang.build import sglang
from kvfuzz.scheduler.sglang.session import SGLangSession
from kvfuzz.scheduler.violations import Check, SchedulerViolation

PRESSED = SchedulerSetup(
    num_blocks=8, block_size=4, max_num_batched_tokens=32, max_num_seqs=8, eos=True, schedule_conservativeness=0.3
)
"""8 pages of 4, the new-token ratio starting at 0.21: the adder reserves a fifth of a running request's output."""

PROGRAM = ((14, 9, 2), (12, 6, 1), (1, 8, 2), (1, 15, 0))
"""(prompt length, max_tokens, steps after it) of each request, all ending at EOS: r0's nine outputs hold no EOS."""


def play(session: SGLangSession) -> SGLangSession:
    for length, max_tokens, steps in PROGRAM:
        session.add([1] * length, max_tokens, eos=True)
        for _ in range(steps):
            session.step()
    session.drain()
    return session


def test_a_pressed_pool_retracts_and_every_output_is_the_fake_models() -> None:
    session = play(SGLangSession(PRESSED))
    assert session.preemptions >= 1  # retract_decode retracted a decoding request
    retracted = [req.rid for req in session.loop.requests.values() if req.retraction_count]
    assert retracted, "a request was retracted and resumed"
    for request, expected in session.outputs.requests.items():
        assert expected.finished and expected.received == expected.whole(request), request


def test_at_conservativeness_one_the_same_program_does_not_retract() -> None:
    from attrs import evolve

    assert play(SGLangSession(evolve(PRESSED, schedule_conservativeness=1.0))).preemptions == 0


def test_a_retraction_that_discards_the_output_is_caught_by_the_outputs_check(monkeypatch: pytest.MonkeyPatch) -> None:
    req_class = sglang().Req
    original = req_class.reset_for_retract

    def reset_for_retract(self: Any) -> None:
        original(self)
        self.output_ids = array("q")  # as for an input_embeds request: the output regenerated from scratch

    monkeypatch.setattr(req_class, "reset_for_retract", reset_for_retract)
    with pytest.raises(SchedulerViolation) as caught:
        play(SGLangSession(PRESSED))
    assert caught.value.check == Check.OUTPUTS and "no longer start with" in str(caught.value), caught.value


def test_a_retraction_that_frees_a_kept_request_s_page_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    batch_class = sglang().ScheduleBatch
    original = batch_class.release_req

    def release_req(self: Any, idx: int, remaining: int, offload_kv: bool = True) -> bool:
        kept = next(req for index, req in enumerate(self.reqs) if index != idx and req.kv.holds_kv)
        row = self.req_to_token_pool.req_to_token[kept.kv.req_pool_idx]
        page = int(row[0]) // self.token_to_kv_pool_allocator.page_size
        first = page * self.token_to_kv_pool_allocator.page_size
        released = bool(original(self, idx, remaining, offload_kv))
        self.token_to_kv_pool_allocator.free(torch.tensor([first], dtype=torch.int64))  # the wrong request's page
        return released

    monkeypatch.setattr(batch_class, "release_req", release_req)
    with pytest.raises(SchedulerViolation) as caught:
        play(SGLangSession(PRESSED))
    assert caught.value.check in (Check.ACCOUNTING, Check.EXCLUSIVE, Check.CONTENT), caught.value
