"""``kvfuzz run --scheduler sglang``: SGLang's SchedulePolicy, PrefillAdder and ScheduleBatch over its radix cache,
in kvfuzz's copy of the Scheduler's loop, every check on (docs/sglang.md). Each check is shown able to fail on a
bug seeded into SGLang's own code by a monkeypatch, found by the search from random requests.

Runs in SGLang's own environment (``scripts/third_party_env.sh sglang``; CI runs it there)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.search import Outcome, search
from kvfuzz.scheduler.sglang.build import sglang
from kvfuzz.scheduler.sglang.session import SGLangSession
from kvfuzz.scheduler.violations import Check, SchedulerViolation

SMALL = SchedulerSetup(num_blocks=8, block_size=4)
PREFIX = [0, 1, 2, 0, 1, 2, 0, 1]  # two full pages


def _search(setup: SchedulerSetup, examples: int = 25, sampler: Any = None) -> Outcome:
    def session() -> SGLangSession:
        return SGLangSession(setup) if sampler is None else SGLangSession(setup, sampler)

    return search(setup, examples, 50, shrink=False, session=session, name="SGLangSchedulerMachine")


def test_a_program_with_prefix_hits_runs_clean_and_outputs_are_the_fake_models() -> None:
    session = SGLangSession(SMALL)
    first = session.add(PREFIX + [3], 3)
    session.step()  # r0 prefilled: its two full pages go into the tree
    second = session.add(PREFIX + [2, 2], 2)
    session.step()
    session.drain()
    assert session.hit_tokens == 8  # r1 found r0's two pages in the radix cache
    for request in (first, second):
        expected = session.outputs.requests[request]
        assert expected.finished and len(expected.received) == expected.max_tokens


def test_a_page_size_of_one_is_refused_in_one_line_before_any_work(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfuzz.cli import main

    assert main(["run", "--scheduler", "sglang", "--block-size", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "kvfuzz: --scheduler sglang needs --block-size >= 2 (SGLang serves page size 1 with another allocator)"
    ]


def test_the_search_passes_on_sglang_as_released() -> None:
    outcome = _search(SMALL)
    assert outcome.failure is None, outcome.describe()
    assert outcome.hit_tokens > 0


def _suffix_written_over_the_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare_for_extend's write locations ignore the prefix: a request with a radix hit has its suffix's K/V
    written at the slots of positions 0.., the start of the shared cached pages."""
    batch_class = sglang().ScheduleBatch
    original = batch_class.prepare_for_extend

    def prepare_for_extend(self: Any) -> None:
        original(self)
        rows = self.req_to_token_pool.req_to_token
        pieces, prefixes = [], [int(n) for n in self.prefix_lens]
        offset = 0
        for req, prefix, count in zip(self.reqs, prefixes, self.extend_lens):
            pieces.append(
                rows[req.kv.req_pool_idx, :count].to(self.out_cache_loc.dtype)
                if prefix
                else self.out_cache_loc[offset : offset + count]
            )
            offset += count
        self.out_cache_loc = torch.cat(pieces)

    monkeypatch.setattr(batch_class, "prepare_for_extend", prepare_for_extend)


def test_a_suffix_written_over_the_shared_prefix_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    _suffix_written_over_the_prefix(monkeypatch)
    session = SGLangSession(SMALL)
    session.add(PREFIX + [3], 4)
    session.step()
    session.step()  # r0 decoding, relying on its prefix
    session.add(PREFIX + [2, 2], 2)
    with pytest.raises(SchedulerViolation) as caught:
        session.step()
    assert caught.value.check is Check.EXCLUSIVE
    assert "request r1" in str(caught.value) and "which request r0 relies on for its position 0" in str(caught.value)


def test_the_search_finds_the_suffix_written_over_the_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    _suffix_written_over_the_prefix(monkeypatch)
    outcome = _search(SMALL)
    assert outcome.check() in ("exclusive", "content"), outcome.describe()


def _release_frees_the_protected_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """release_kv_cache gives back the request's whole row, the prefix the radix tree holds (and other requests
    may lock) included, instead of from ``cache_protected_len``."""
    cache_class = sglang().UnifiedRadixCache
    original = cache_class.free_kv_row

    def free_kv_row(self: Any, kv: Any, ranges: list[tuple[int, int]]) -> None:
        protected = kv.cache_protected_len
        if ranges and ranges[0][0] == protected and protected > 0:
            ranges = [(0, ranges[0][1]), *ranges[1:]]
        original(self, kv, ranges)

    monkeypatch.setattr(cache_class, "free_kv_row", free_kv_row)


def test_a_release_that_frees_the_tree_s_pages_is_caught_by_accounting(monkeypatch: pytest.MonkeyPatch) -> None:
    _release_frees_the_protected_prefix(monkeypatch)
    session = SGLangSession(SMALL)
    session.add(PREFIX + [3], 1)
    with pytest.raises(SchedulerViolation) as caught:
        session.step()  # r0 prefilled and finished: its two full pages go into the tree, and back to the pool
    assert caught.value.check is Check.ACCOUNTING and caught.value.step == 1
    assert "is free and held by the radix tree" in str(caught.value)


def test_the_search_finds_the_release_of_the_protected_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    _release_frees_the_protected_prefix(monkeypatch)
    outcome = _search(SMALL)
    assert outcome.check() == "accounting", outcome.describe()


def test_a_model_whose_tokens_sglang_reports_otherwise_is_caught_by_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's decode result processing hands SGLang a token other than the one sampled."""
    loop_class = type(SGLangSession(SMALL).loop)
    original = loop_class.process

    def process(self: Any, batch: Any, next_token_ids: list[int]) -> None:
        if not batch.forward_mode.is_extend():
            next_token_ids = [(token + 1) % 4 for token in next_token_ids]
        original(self, batch, next_token_ids)

    monkeypatch.setattr(loop_class, "process", process)
    outcome = _search(SMALL, examples=10)
    assert outcome.check() == "outputs", outcome.describe()
    assert "but the fake model sampled" in outcome.explanation()


def test_a_stuck_request_is_caught_by_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """The PrefillAdder never admits a request whose prompt is longer than one page."""
    adder_class = sglang().PrefillAdder
    original = adder_class.add_one_req

    def add_one_req(self: Any, req: Any, **kwargs: Any) -> Any:
        if len(req.origin_input_ids) > SMALL.block_size:
            return sglang().AddReqResult.NO_TOKEN
        return original(self, req, **kwargs)

    monkeypatch.setattr(adder_class, "add_one_req", add_one_req)
    outcome = _search(SMALL, examples=10)
    assert outcome.check() == "progress", outcome.describe()
    assert "waiting" in outcome.explanation()


def test_the_candidate_finding_an_ignore_eos_request_clipped_to_the_pool_is_never_admitted_without_the_cache() -> None:
    """Kept so the finding is not lost (docs/sglang.md; SGLang scheduler traces are not saved yet): with
    the radix cache disabled, a request init_req_max_new_tokens clips to fit the empty pool (9 + 7 tokens of 24)
    is never admitted by add_one_req_ignore_eos. This test fails the day SGLang admits it: then it is fixed."""
    session = SGLangSession(SchedulerSetup(num_blocks=6, prefix_caching=False))
    request = session.add([0, 1, 2, 0, 1, 2, 0, 1, 0], 7)
    assert session.outputs.requests[request].max_tokens == 7  # SGLang's clip leaves the request as asked
    with pytest.raises(SchedulerViolation) as caught:
        session.drain()
    assert caught.value.check is Check.PROGRESS and caught.value.step == 1
    assert "r0 (waiting, 0 of 7 output tokens)" in str(caught.value)


def test_the_same_request_with_the_radix_cache_on_is_admitted_and_finishes() -> None:
    session = SGLangSession(SchedulerSetup(num_blocks=6))
    request = session.add([0, 1, 2, 0, 1, 2, 0, 1, 0], 7)
    session.drain()
    assert session.outputs.requests[request].finished


@pytest.mark.parametrize(
    "flag",
    [
        ["--policy", "priority"],
        ["--async-scheduling"],
        ["--stop-tokens"],
        ["--min-tokens"],
        ["--max-loras", "2"],
        ["--long-prefill-token-threshold", "2"],
        ["--max-num-active-seqs", "1"],
        ["--prefill-schedule-interval", "2"],
        ["--pauses"],
    ],
)
def test_vllm_only_options_are_refused_in_one_line(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from kvfuzz.cli import main

    assert main(["run", "--scheduler", "sglang", *flag]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"kvfuzz: --scheduler sglang does not take {flag[0]}")
