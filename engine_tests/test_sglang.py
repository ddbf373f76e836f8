"""SGLang's RadixCache behind kvfuzz's contract (kvfuzz.adapters.sglang).

Runs in SGLang's own environment (``scripts/third_party_env.sh sglang``; CI runs it there): without SGLang the
import fails loudly rather than skipping.
"""

from __future__ import annotations

import pytest
from hypothesis.stateful import run_state_machine_as_test

from kvfuzz.adapters.sglang import SGLangRadixAllocator, radix_cache
from kvfuzz.adapters.sglang._engine import in_context
from kvfuzz.allocator import OutOfBlocks, PoolSpec
from kvfuzz.engine import Engine
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.profiles import PROFILES
from kvfuzz.statemachines import MachineConfig, machine_for

PROMPT = (1, 2, 3, 0, 2, 2, 1, 3)  # two full pages of four tokens


def test_machine_under_the_ci_profile() -> None:
    run_state_machine_as_test(machine_for(radix_cache, MachineConfig()), settings=PROFILES["ci"])


def test_the_pool_has_exactly_the_spec_blocks_with_page_zero_kept_back() -> None:
    allocator = radix_cache(PoolSpec(block_size=4, num_blocks=8))
    assert allocator.token_pool.num_pages == 8
    assert sorted(allocator.free_blocks()) == list(range(8))  # SGLang's pages 1..8; padding page 0 never handed out
    assert not allocator.cached_blocks()


def test_block_table_and_slots_are_read_off_the_req_to_token_row() -> None:
    allocator = radix_cache(PoolSpec(block_size=4, num_blocks=8))
    admitted = allocator.admit("s0", (), PROMPT + (0,))
    state = allocator._requests["s0"]
    row = allocator.req_to_token_pool.req_to_token[state.req.kv.req_pool_idx]
    assert admitted.block_table == tuple(int(row[i]) // 4 - 1 for i in (0, 4, 8))
    assert admitted.num_cached_tokens == 0
    allocator.step_completed(0)
    grown = allocator.grow("s0", (3,))
    assert [(slot.block, slot.offset) for slot in grown.slots] == [(int(row[9]) // 4 - 1, int(row[9]) % 4)]
    assert grown.slots[0].block == allocator.block_table("s0")[2]
    assert sorted(allocator.free_blocks()) == sorted(set(range(8)) - set(admitted.block_table))


def test_out_of_blocks_changes_nothing() -> None:
    allocator = radix_cache(PoolSpec(block_size=4, num_blocks=3))
    allocator.admit("s0", (), PROMPT)
    before = (allocator.block_table("s0"), sorted(allocator.free_blocks()), sorted(allocator.cached_blocks()))
    with pytest.raises(OutOfBlocks):
        allocator.admit("s1", (), (3,) * 8)
    with pytest.raises(OutOfBlocks):
        allocator.grow("s0", (0,) * 5)
    assert (allocator.block_table("s0"), sorted(allocator.free_blocks()), sorted(allocator.cached_blocks())) == before


def test_a_finished_prompt_is_matched_page_aligned_and_one_token_short_within_its_namespace() -> None:
    allocator = radix_cache(PoolSpec(block_size=4, num_blocks=16))
    first = allocator.admit("s0", ("tenant",), PROMPT)
    allocator.step_completed(0)
    allocator.free("s0")
    assert sorted(allocator.cached_blocks()) == sorted(first.block_table)
    # SGLang matches at most len - 1 tokens, floored to a page: an identical prompt hits its first page only.
    assert allocator.admit("s1", ("tenant",), PROMPT).num_cached_tokens == 4
    assert allocator.admit("s2", ("tenant",), PROMPT + (0,)).num_cached_tokens == 8
    assert allocator.admit("s3", ("tenant", "salt"), PROMPT + (0,)).num_cached_tokens == 0
    assert allocator.admit("s4", (), PROMPT + (0,)).num_cached_tokens == 0


class _CheckpointsAtAdmission(SGLangRadixAllocator):
    """Inserts a prompt into the tree as soon as it is admitted, before any step computed it (bug class 5)."""

    @in_context
    def admit(self, seq, namespace, tokens):
        result = SGLangRadixAllocator.admit.__wrapped__(self, seq, namespace, tokens)
        self._checkpoint(self._requests[seq])
        return result


def test_pages_matchable_before_their_step_are_caught() -> None:
    engine = Engine(_CheckpointsAtAdmission(MachineConfig().pool_spec()), MachineConfig())
    engine.admit("s0", (), PROMPT + (0,))
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("s1", (), PROMPT + (1,))
    assert caught.value.invariant is Invariant.CACHE_SOUNDNESS


def test_the_timeline_names_the_library_blocks(tmp_path) -> None:
    """``kvfuzz show`` replays the corpus trace here and labels every device lane with the library's own id
    (SGLang's page 0 is its padding page: kvfuzz's block b is SGLang's page b + 1)."""
    from pathlib import Path

    from kvfuzz.saved.trace import load
    from kvfuzz.timeline.html import render_html
    from kvfuzz.timeline.record import record

    corpus = Path(__file__).resolve().parent.parent / "corpus"
    path = corpus / "sglang-radix-cache-lora-cache-soundness-d851dea53690.json"
    timeline = record(load(path), str(path))
    assert timeline.outcome.verdict == "reproduced"
    device = [lane for lane in timeline.lanes if lane.pool == "device"]
    assert device
    for lane in device:
        assert lane.library_name == f"SGLang page {lane.block + 1}"
    page = render_html(timeline)
    assert all(lane.library_name in page for lane in device)


def _cache_two_prompts(engine: Engine) -> None:
    """Two finished two-page prompts that share nothing: two cached leaves of two pages each in the tree."""
    engine.admit("s0", (), PROMPT)
    engine.admit("s1", (), (3, 3, 3, 3, 0, 0, 0, 0))
    engine.step()
    engine.free("s0")
    engine.free("s1")


def test_evict_rounds_up_to_whole_leaves_and_is_checked_exactly() -> None:
    engine = Engine(radix_cache(MachineConfig().pool_spec()), MachineConfig())
    _cache_two_prompts(engine)
    allocator = engine.allocator
    assert len(allocator.cached_blocks()) == 4
    dropped = allocator.evict(1)  # at least one page: SGLang drops one whole two-page leaf
    assert dropped == 2
    assert len(allocator.cached_blocks()) == 2
    engine.evict(1)  # the engine's checks accept the rounding: 2 more, everything cached
    assert not allocator.cached_blocks()
    assert engine.stats["evicted blocks"] == 2


class _EvictStopsAtOneLeaf(SGLangRadixAllocator):
    """Reports the tokens SGLang evicted, but asks it for one page only, whatever n is: a rounding eviction that
    stops short."""

    @in_context
    def evict(self, num_blocks):
        return SGLangRadixAllocator.evict.__wrapped__(self, min(num_blocks, 1))


def test_a_rounding_eviction_that_stops_short_is_caught() -> None:
    engine = Engine(_EvictStopsAtOneLeaf(MachineConfig().pool_spec()), MachineConfig())
    _cache_two_prompts(engine)
    with pytest.raises(InvariantViolation) as caught:
        engine.evict(3)
    assert caught.value.invariant is Invariant.FREE_SET
    assert "at least 3" in str(caught.value)


def test_reset_cache_drops_every_unlocked_page() -> None:
    engine = Engine(radix_cache(MachineConfig().pool_spec()), MachineConfig())
    _cache_two_prompts(engine)
    engine.admit("s2", (), PROMPT + (0,))  # locks the first prompt's pages
    engine.reset_cache()
    assert not engine.allocator.cached_blocks()
    assert engine.allocator.admit("s3", (), PROMPT + (0,)).num_cached_tokens == 8  # locked pages stay matchable


@pytest.mark.parametrize(
    "spec", ["kvfuzz.adapters.sglang.adapter:radix_cache", "kvfuzz.adapters.sglang.hicache:hiradix_cache"]
)
def test_an_allocator_campaign_s_coverage_measures_sglang_s_mem_cache(spec: str) -> None:
    from kvfuzz.coverage.scope import KVFUZZ, allocator_scope
    from kvfuzz.registry import load_factory

    files = allocator_scope(load_factory(spec)).files()
    assert any(file.endswith("sglang/srt/mem_cache/radix_cache.py") for file in files), files
    assert not any(file.startswith(KVFUZZ) for file in files)
