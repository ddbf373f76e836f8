"""vLLM v1's KV-cache manager behind kvfuzz (kvfuzz.adapters.vllm_v1).

Runs in its own environment (``scripts/third_party_env.sh vllm``; CI runs it there): without vLLM 0.33.0 the
import fails loudly rather than skipping.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvfuzz.adapters import vllm_v1
from kvfuzz.allocator import InvalidArgument, OutOfBlocks, PoolSpec, UnknownSequence, Unsupported
from kvfuzz.allocator.types import NULL_BLOCK
from kvfuzz.profiles import PROFILES
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Target
from kvfuzz.program.replay import replay
from kvfuzz.runner import run
from kvfuzz.saved.corpus import trace_signature
from kvfuzz.saved.trace import load
from kvfuzz.statemachines import MachineConfig, machine_for

SPEC = PoolSpec(block_size=4, num_blocks=6)
PROMPT = (1, 2, 3, 0, 2, 2, 1, 3, 1)  # two full blocks and one token


@pytest.mark.parametrize(
    "factory, examples",
    [
        (vllm_v1.kv_cache_manager, None),
        (vllm_v1.kv_cache_manager_no_prefix_cache, None),
        (vllm_v1.kv_cache_manager_lora, 40),
        (vllm_v1.kv_cache_manager_deferred_free, 40),
        (vllm_v1.kv_cache_manager_sliding_window, 40),
        (vllm_v1.kv_cache_manager_no_prefix_cache_deferred_free, 40),
        (vllm_v1.kv_cache_manager_no_prefix_cache_sliding_window, 40),
        (vllm_v1.kv_cache_manager_spec_decode, 40),
        (vllm_v1.kv_cache_manager_ngram_spec_decode, 40),
        (vllm_v1.kv_cache_manager_spec_decode_deferred_free, 40),
    ],
    ids=lambda value: getattr(value, "__name__", str(value)),
)
def test_machine_holds_under_fcfs(factory, examples) -> None:
    """kvfuzz's ci profile (fewer examples for the variants, to keep the suite short)."""
    profile = PROFILES["ci"] if examples is None else settings(PROFILES["ci"], max_examples=examples)
    run_state_machine_as_test(machine_for(factory, MachineConfig()), settings=profile)


def test_blocks_are_matchable_when_scheduled_and_declared_so() -> None:
    """vLLM registers full blocks when their tokens are scheduled: a request admitted in the same round hits them
    before any step completes. The adapter declares the three behaviours that follow (a hit on scheduled writes,
    same-round sharing, an abort that still lands its step's writes), so the machine holds vLLM to exactly them."""
    allocator = vllm_v1.kv_cache_manager(SPEC)
    caps = allocator.capabilities
    assert caps.hits_scheduled_writes and caps.shares_scheduled_blocks and caps.free_lands_scheduled_writes
    assert not caps.preempt_scheduled
    allocator.admit("a", (), PROMPT)
    assert allocator.admit("b", (), PROMPT + (0,)).num_cached_tokens == 8  # before any step_completed


def test_priority_policy_finds_the_withdrawn_request_bug() -> None:
    """Under the priority policy a request scheduled this round may be preempted; its registered blocks keep their
    hashes though no step writes them (vllm-project/vllm PR #43569, open), and a later hit reads nothing."""
    summary = run(vllm_v1.kv_cache_manager_priority, MachineConfig(), examples=50)
    assert summary.failed and summary.invariant == "invariant 9 (cache soundness)", summary.explanation
    assert "nothing has been written there" in summary.explanation


def test_pool_of_exactly_num_blocks_without_the_null_block() -> None:
    allocator = vllm_v1.kv_cache_manager(SPEC)
    assert sorted(allocator.free_blocks()) == list(range(SPEC.num_blocks))
    assert allocator.cached_blocks() == [] and allocator.pending_blocks() == []
    table = allocator.admit("a", (), tuple(range(4)) * SPEC.num_blocks).block_table
    assert sorted(table) == list(range(SPEC.num_blocks))
    assert all(allocator.refcount(block) == 1 for block in table) and allocator.free_blocks() == []
    with pytest.raises(OutOfBlocks):
        allocator.grow("a", (0,))
    assert allocator.block_table("a") == table
    allocator.free("a")
    assert sorted(allocator.cached_blocks()) == list(range(SPEC.num_blocks))
    allocator.reset_cache()
    assert sorted(allocator.free_blocks()) == list(range(SPEC.num_blocks)) and allocator.cached_blocks() == []


def test_hits_need_the_same_namespace_and_survive_a_refused_grow() -> None:
    for factory in (vllm_v1.kv_cache_manager, vllm_v1.kv_cache_manager_lora):
        allocator = factory(PoolSpec(block_size=4, num_blocks=16))
        first = allocator.admit("a", ("ab", "c"), PROMPT)
        allocator.step_completed(0)
        assert allocator.admit("b", ("a", "bc"), PROMPT).num_cached_tokens == 0
        assert allocator.admit("c", (), PROMPT).num_cached_tokens == 0
        allocator.free("b")
        allocator.free("c")
        with pytest.raises(OutOfBlocks):
            allocator.grow("a", (0,) * 60)
        allocator.grow("a", (3, 0, 0))  # fills logical block 2 with (1, 3, 0, 0): the refused tokens are gone
        allocator.step_completed(1)
        hit = allocator.admit("d", ("ab", "c"), PROMPT + (3, 0, 0, 2))
        assert hit.num_cached_tokens == 12 and hit.block_table[:3] == allocator.block_table("a")[:3]
        assert allocator.refcount(first.block_table[0]) == 2


def test_deferred_free_holds_blocks_until_the_fence_step_completes() -> None:
    allocator = vllm_v1.kv_cache_manager_deferred_free(SPEC)
    assert allocator.capabilities.inflight_window == 1
    table = allocator.admit("a", (), PROMPT).block_table
    allocator.free("a")
    assert sorted(allocator.pending_blocks()) == sorted(table)
    assert all(allocator.refcount(block) == 0 for block in table)
    assert not set(table) & set(allocator.free_blocks()) | set(allocator.cached_blocks())
    allocator.step_completed(0)
    assert allocator.pending_blocks() == []
    assert sorted(allocator.free_blocks() + allocator.cached_blocks()) == list(range(SPEC.num_blocks))


def test_sliding_window_drops_blocks_as_null_entries() -> None:
    allocator = vllm_v1.kv_cache_manager_no_prefix_cache_sliding_window(PoolSpec(block_size=4, num_blocks=8))
    allocator.admit("a", (), tuple(range(4)) * 5)
    allocator.step_completed(0)
    allocator.grow("a", (1,))
    table = allocator.block_table("a")
    assert table[:2] == (NULL_BLOCK, NULL_BLOCK) and NULL_BLOCK not in table[2:]
    assert len(allocator.free_blocks()) == 8 - len(table[2:])


def test_misuse_and_unsupported_operations_are_refused() -> None:
    allocator = vllm_v1.kv_cache_manager(SPEC)
    allocator.admit("a", (), PROMPT)
    allocator.preempt("a")
    for call in (lambda: allocator.grow("a", (1,)), lambda: allocator.free("a"), lambda: allocator.free("nobody")):
        with pytest.raises(UnknownSequence):
            call()
    assert not hasattr(allocator, "fork")  # never declared by any factory: no stub
    with pytest.raises(Unsupported):  # declared only by the speculative-decoding factories
        allocator.rollback("a", 1)


def test_the_timeline_names_the_library_blocks(tmp_path) -> None:
    """``kvfuzz show`` replays the corpus trace here and labels every device lane with the library's own id
    (vLLM reserves block 0 as its null block: kvfuzz's block b is vLLM's b + 1)."""
    from pathlib import Path

    from kvfuzz.saved.trace import load
    from kvfuzz.timeline.html import render_html
    from kvfuzz.timeline.record import record

    corpus = Path(__file__).resolve().parent.parent / "corpus"
    path = corpus / "vllm-v1-kv-cache-manager-cache-soundness-382d392d8a83.json"
    timeline = record(load(path), str(path))
    assert timeline.outcome.verdict == "reproduced"
    device = [lane for lane in timeline.lanes if lane.pool == "device"]
    assert device
    for lane in device:
        assert lane.library_name == f"vLLM block {lane.block + 1}"
    page = render_html(timeline)
    assert all(lane.library_name in page for lane in device)


def test_speculative_decoding_keeps_the_blocks_of_rejected_drafts_and_never_caches_a_draft() -> None:
    """allocate_slots reserves num_lookahead_tokens beyond the drafts; a rejection lowers num_computed_tokens and
    keeps every block; only verified tokens are ever cached."""
    allocator = vllm_v1.kv_cache_manager_spec_decode(PoolSpec(block_size=4, num_blocks=16))
    caps = allocator.capabilities
    assert caps.rollback and caps.speculative_tokens == 3 and caps.lookahead_blocks == 2  # ceil((3 + 3) / 4)
    assert len(allocator.admit("a", (), PROMPT).block_table) == 3  # ceil((9 + 3) / 4)
    allocator.step_completed(0)
    allocator.grow("a", (5, 6, 7, 8))  # the sampled token 5, then drafts 6, 7, 8
    table = allocator.block_table("a")
    assert len(table) == 4  # ceil((13 + 3) / 4)
    allocator.step_completed(1)
    assert allocator.admit("b", (), PROMPT + (5, 6, 7, 8)).num_cached_tokens == 8  # (1, 5, 6, 7) holds drafts
    allocator.free("b")
    allocator.rollback("a", 2)  # 7 and 8 rejected
    assert allocator.block_table("a") == table
    with pytest.raises(InvalidArgument):
        allocator.rollback("a", 2)  # only draft 6 is left to reject
    allocator.grow("a", (9,))  # 6 accepted, 9 sampled: block 2 is (1, 5, 6, 9), verified
    assert allocator.block_table("a") == table
    allocator.step_completed(2)
    hit = allocator.admit("c", (), PROMPT + (5, 6, 9, 1))
    assert hit.num_cached_tokens == 12 and hit.block_table[:3] == table[:3]


def test_rollback_reaches_only_the_drafts_of_the_latest_grow() -> None:
    allocator = vllm_v1.kv_cache_manager_ngram_spec_decode(SPEC)
    assert allocator.capabilities.lookahead_blocks == 1  # ceil((3 + 0) / 4)
    allocator.admit("a", (), PROMPT)
    with pytest.raises(InvalidArgument):
        allocator.rollback("a", 1)  # a prompt holds no drafts
    allocator.grow("a", (1, 2, 3, 0, 1, 2))  # three known tokens, then three drafts
    allocator.rollback("a", 3)
    allocator.grow("a", (3,))
    with pytest.raises(InvalidArgument):
        allocator.rollback("a", 1)


def test_evict_blocks_cuts_a_cached_chain_in_the_middle() -> None:
    """Targeted eviction (KV connectors' invalid blocks, offloading): evicting the middle block of a cached chain
    stops the next hit before it, though the blocks after it keep their hashes; kvfuzz drives it as
    ``evict_blocks`` and checks the hit does not run on past the evicted block."""
    from kvfuzz.engine import Engine

    engine = Engine(vllm_v1.kv_cache_manager_kv_connector(SPEC), MachineConfig(block_size=4, num_blocks=6))
    prompt = PROMPT[:8] + (0, 1, 2, 3, 0)  # three full blocks and one token
    engine.admit("a", (), prompt)
    engine.step()
    table = engine.expected.seqs["a"].table
    engine.free("a")
    assert engine.allocator.capabilities.targeted_eviction
    assert sorted(engine.allocator.cached_blocks()) == sorted(table[:3])
    engine.evict_blocks((table[1],))
    assert sorted(engine.allocator.cached_blocks()) == sorted((table[0], table[2]))
    assert engine.allocator.admit("b", (), prompt).num_cached_tokens == 4  # the first block only


def test_the_default_factory_declares_the_policies_and_a_kv_connector_adds_targeted_eviction() -> None:
    default, connector = vllm_v1.kv_cache_manager(SPEC), vllm_v1.kv_cache_manager_kv_connector(SPEC)
    assert default.capabilities.complete_caching and default.capabilities.eviction_order is not None
    assert not default.capabilities.targeted_eviction
    assert connector.capabilities.targeted_eviction and connector.capabilities.eviction_order is not None


def test_a_kv_connector_eviction_breaks_the_lru_order() -> None:
    """vLLM's evict_blocks leaves the evicted blocks where they are in the free queue, behind cached ones, so the
    next allocation evicts a cached block while they stand free (corpus/vllm-v1-kv-cache-manager-kv-connector-*)."""
    from kvfuzz.engine import Engine, Invariant, InvariantViolation

    config = MachineConfig(block_size=4, num_blocks=4)
    engine = Engine(vllm_v1.kv_cache_manager_kv_connector(config.pool_spec()), config)
    engine.admit("s0", (), PROMPT)
    engine.step()
    engine.free("s0")  # free queue: the partial block, the unused one, then blocks 1 and 0, cached
    engine.evict_blocks((0,))  # block 0 loses its hash but stays last in the queue
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("s1", (), (3, 2, 1, 0, 0, 0, 0, 0, 0))  # pops three blocks: the third is block 1, cached
    assert caught.value.invariant is Invariant.EVICTION_ORDER
    assert "reused cached block 1 for new content while block 0 was free" in str(caught.value)


def _without_the_order(spec: PoolSpec) -> vllm_v1.VllmV1Allocator:
    allocator = vllm_v1.kv_cache_manager_kv_connector(spec)
    allocator.capabilities = attrs.evolve(allocator.capabilities, eviction_order=None)
    return allocator


def test_machine_holds_under_targeted_eviction_apart_from_the_order() -> None:
    """Everything but the order finding holds with a KV connector's evictions: no hit runs on past an evicted block,
    and every other computed block stays matchable."""
    run_state_machine_as_test(
        machine_for(_without_the_order, MachineConfig()), settings=settings(PROFILES["ci"], max_examples=60)
    )


def test_a_block_holding_drafts_when_written_is_not_owed_matchable() -> None:
    """Found by a campaign: block 1 (8 slots) is written at step 0 with 5 verified tokens and 3 drafts; one draft is
    rejected and the request preempted. vLLM caches only verified tokens, so block 1 (15 tokens then) is not cached,
    and complete caching must not owe it."""
    calls = [
        Call("admit", {"seq": "s0", "namespace": (), "system": (), "suffix": [0] * 7}),
        Call("grow", {"seq": "s0", "tokens": [0] * 9}),
        Call("step", {}),
        Call("rollback", {"seq": "s0", "num_tokens": 1}),
        Call("preempt", {"seq": "s0"}),
        Call("readmit", {"seq": "s0"}),
    ]
    config = MachineConfig(block_size=8, num_blocks=3, num_host_blocks=0)
    outcome = replay(Target(vllm_v1.kv_cache_manager_spec_decode, config), calls)
    assert outcome.failure is None, outcome.failure


def test_the_withdrawn_request_bug_is_one_finding_however_its_hit_is_noticed() -> None:
    """The three corpus traces of the withdrawn-request bug fail with three causes (a hit on unwritten K/V, on
    another prefix's K/V, on scheduled writes then withdrawn); each diverged at the preemption that left the
    withdrawn blocks cached (or failed there), so their signatures are one."""
    corpus = Path(__file__).resolve().parent.parent / "corpus"
    traces = [
        load(path)
        for path in sorted(corpus.glob("vllm-v1-kv-cache-manager-*.json"))
        if "withdrawn" in path.name or "cache-soundness" in path.name
    ]
    assert len(traces) == 3
    signatures = {trace_signature(trace, 30.0) for trace in traces}
    assert None not in signatures
    assert len(signatures) == 1, signatures
    (signature,) = signatures
    assert signature is not None and signature.cause == "a cache hit on scheduled writes that were then withdrawn"


@pytest.mark.parametrize(
    "spec, measured",
    [
        ("kvfuzz.adapters.vllm_v1:kv_cache_manager", "vllm/v1/core/block_pool.py"),
        ("kvfuzz.adapters.vllm_hybrid:kv_cache_manager_hybrid", "vllm/v1/core/kv_cache_coordinator.py"),
        ("kvfuzz.adapters.vllm_offload:cpu_offloading", "vllm/v1/kv_offload/cpu/manager.py"),
    ],
)
def test_an_allocator_campaign_s_coverage_measures_vllm_s_code(spec: str, measured: str) -> None:
    """The adapter declares the engine package it drives (CODE_UNDER_TEST): --coverage measures vLLM's files, never
    the adapter's own (docs/coverage.md)."""
    from kvfuzz.coverage.scope import KVFUZZ, allocator_scope
    from kvfuzz.registry import load_factory

    files = allocator_scope(load_factory(spec)).files()
    assert any(file.endswith(measured) for file in files), files
    assert not any(file.startswith(KVFUZZ) for file in files)


def test_a_covered_allocator_campaign_reaches_vllm_s_block_pool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from kvfuzz.cli import main

    argv = ["campaign", "--allocator", "kvfuzz.adapters.vllm_v1:kv_cache_manager", "--workers", "1"]
    argv += [
        "--max-examples",
        "10",
        "--seed",
        "3",
        "--no-known",
        "--corpus",
        str(tmp_path / "c"),
        "--coverage",
        "--json",
    ]
    main(argv)
    files = {file["name"]: file for file in json.loads(capsys.readouterr().out)["coverage"]["files"]}
    assert files["vllm/v1/core/block_pool.py"]["lines_reached"] > 20, files
