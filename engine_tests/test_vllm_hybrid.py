"""vLLM's hybrid KV cache (two KV-cache groups under ``HybridKVCacheCoordinator``) behind kvfuzz
(kvfuzz.adapters.vllm_hybrid).

Runs in vLLM's environment (``scripts/third_party_env.sh vllm``; CI runs it there): without vLLM 0.33.0 the import
fails loudly rather than skipping.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis.stateful import run_state_machine_as_test

from kvfuzz.adapters import vllm_hybrid
from kvfuzz.allocator import PoolSpec
from kvfuzz.allocator.types import NULL_BLOCK, AdmitResult, KVGroup, Namespace, SeqId, Tokens
from kvfuzz.profiles import PROFILES
from kvfuzz.runner import run
from kvfuzz.statemachines import MachineConfig, machine_for

SPEC = PoolSpec(block_size=4, num_blocks=16)
PROMPT = tuple(range(20))  # five full blocks


@pytest.mark.parametrize(
    "factory",
    [
        vllm_hybrid.kv_cache_manager_hybrid,
        vllm_hybrid.kv_cache_manager_hybrid_no_prefix_cache,
        vllm_hybrid.kv_cache_manager_hybrid_sliding_double,
    ],
    ids=lambda factory: factory.__name__,
)
def test_machine_holds(factory) -> None:
    """kvfuzz's ci profile, every group's table checked."""
    run_state_machine_as_test(machine_for(factory, MachineConfig()), settings=PROFILES["ci"])


class _FullAttentionHit(vllm_hybrid.VllmHybridAllocator):
    """A wrong shim: it reports the full-attention group's own hit (vLLM's per-group lookup) where the two groups
    disagree, while vLLM allocates by the hybrid hit."""

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        probe = self._vllm.Request(
            request_id=f"probe-{seq}",
            prompt_token_ids=list(tokens),
            sampling_params=self._sampling,
            pooling_params=None,
            block_hasher=self._hasher,
            **self._keys.request_kwargs(namespace),
        )
        _, (full_hit, _) = self._manager.coordinator.find_longest_cache_hit_per_group(
            probe.block_hashes, len(tokens) - 1
        )
        result = super().admit(seq, namespace, tokens)
        return attrs.evolve(result, num_cached_tokens=max(full_hit, result.num_cached_tokens))


def _full_attention_hit(spec: PoolSpec) -> _FullAttentionHit:
    from kvfuzz.adapters.vllm_v1 import VllmOptions

    return _FullAttentionHit(spec, VllmOptions(sliding_window=8))


def test_a_shim_reporting_the_full_attention_hit_alone_is_caught() -> None:
    """The hit where the sliding-window group's window was evicted: the wrong shim claims tokens whose blocks vLLM
    handed out fresh, and the machine finds the claim unsound."""
    summary = run(_full_attention_hit, MachineConfig(num_blocks=64), examples=300)
    assert summary.failed and summary.invariant == "invariant 9 (cache soundness)", summary.explanation


def _in_tables(tables) -> list[int]:
    return [block for table in tables for block in table if block != NULL_BLOCK]


def test_two_groups_build_the_hybrid_coordinator_and_are_declared() -> None:
    """Two KV-cache groups make vLLM pick HybridKVCacheCoordinator (with prefix caching), its no-prefix-cache
    coordinator otherwise; the adapter declares both groups and no single-group window."""
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator, KVCacheCoordinatorNoPrefixCache

    cached = vllm_hybrid.kv_cache_manager_hybrid(SPEC)
    uncached = vllm_hybrid.kv_cache_manager_hybrid_no_prefix_cache(SPEC)
    assert type(cached._manager.coordinator) is HybridKVCacheCoordinator
    assert type(uncached._manager.coordinator) is KVCacheCoordinatorNoPrefixCache
    for allocator in (cached, uncached):
        assert len(allocator._manager.coordinator.single_type_managers) == 2
        caps = allocator.capabilities
        assert caps.kv_groups == (KVGroup("full attention"), KVGroup("sliding window", sliding_window=8))
        assert caps.sliding_window is None and not caps.complete_caching and caps.eviction_order is None
    assert cached.capabilities.prefix_cache and not uncached.capabilities.prefix_cache


def test_each_group_has_its_own_blocks_from_the_one_pool() -> None:
    """Admission allocates a table in each group from the shared pool: no block in both, every block referenced
    once, and the pool kvfuzz sees (the null block hidden) is exactly what the tables leave."""
    allocator = vllm_hybrid.kv_cache_manager_hybrid(SPEC)
    result = allocator.admit("a", (), PROMPT)
    full, sliding = allocator.group_block_tables("a")
    assert result.block_table == full == allocator.block_table("a")
    assert len(full) == len(sliding) == 5 and NULL_BLOCK not in full + sliding
    assert not set(full) & set(sliding)
    assert all(allocator.refcount(block) == 1 for block in full + sliding)
    assert sorted(allocator.free_blocks()) == sorted(set(range(SPEC.num_blocks)) - set(full + sliding))


def test_the_sliding_group_drops_blocks_out_of_its_window_and_the_full_group_keeps_them() -> None:
    """Once the prompt's step has completed, the next allocation drops the sliding-window blocks wholly before
    the window (vLLM's null block, NULL_BLOCK here); full attention keeps every block. The dropped blocks were
    hashed, so they go to the free queue as cached blocks."""
    allocator = vllm_hybrid.kv_cache_manager_hybrid(SPEC)
    allocator.admit("a", (), PROMPT)
    _, before = allocator.group_block_tables("a")
    allocator.step_completed(0)
    slots = allocator.grow("a", (99,)).slots
    full, sliding = allocator.group_block_tables("a")
    # 20 tokens computed, window 8: positions 0..12 are out of it, so blocks 0..2 (positions 0..11) go.
    assert sliding[:3] == (NULL_BLOCK,) * 3 and sliding[3:5] == before[3:5] and NULL_BLOCK not in full
    assert slots[0].block == full[5]  # grow's slots are group 0's
    assert sorted(allocator.cached_blocks()) == sorted(before[:3])
    assert all(allocator.refcount(block) == 0 for block in before[:3])


def test_a_hit_covers_only_the_last_window_of_the_sliding_group() -> None:
    """A hit of the whole 20-token prefix shares every full-attention block, and in the sliding group only the
    two blocks the last window needs (ceil((8 - 1) / 4)); the blocks before them are null in the new table."""
    allocator = vllm_hybrid.kv_cache_manager_hybrid(SPEC)
    allocator.admit("a", (), PROMPT)
    full_a, sliding_a = allocator.group_block_tables("a")
    allocator.step_completed(0)
    hit = allocator.admit("b", (), PROMPT + (7,))
    full_b, sliding_b = allocator.group_block_tables("b")
    assert hit.num_cached_tokens == 20
    assert full_b[:5] == full_a and sliding_b[:5] == (NULL_BLOCK,) * 3 + sliding_a[3:]
    assert full_b[5] != sliding_b[5] and NULL_BLOCK not in (full_b[5], sliding_b[5])
    assert allocator.refcount(sliding_a[3]) == 2 and allocator.refcount(sliding_a[0]) == 1


def test_the_sliding_group_limits_the_hit() -> None:
    """The hybrid rule: the hit is the longest prefix every group holds. With the sliding-window block of
    positions 8..11 evicted, full attention alone still holds 12 tokens, but the sliding window needs two
    contiguous cached blocks ending where the hit ends, so the hit falls back to 8 tokens. A shim that reported
    the full-attention hit would claim 4 tokens whose sliding-window K/V no block holds."""
    allocator = vllm_hybrid.kv_cache_manager_hybrid(SPEC)
    allocator.admit("a", (), PROMPT[:12] + (0,))
    full, sliding = allocator.group_block_tables("a")
    allocator.step_completed(0)
    allocator.free("a")
    allocator.evict_blocks([sliding[2]])
    assert sorted(allocator.cached_blocks()) == sorted(full[:3] + sliding[:2])
    prompt = PROMPT[:12] + (5, 5, 5, 5, 5)
    request = allocator._vllm.Request(
        request_id="probe",
        prompt_token_ids=list(prompt),
        sampling_params=allocator._sampling,
        pooling_params=None,
        block_hasher=allocator._hasher,
    )
    _, per_group = allocator._manager.coordinator.find_longest_cache_hit_per_group(request.block_hashes, 16)
    assert per_group == (12, 8)  # each group alone: full attention holds 12 tokens, the sliding window 8
    hit = allocator.admit("b", (), prompt)
    assert hit.num_cached_tokens == 8
    full_b, sliding_b = allocator.group_block_tables("b")
    assert full_b[:2] == full[:2] and full_b[2] != full[2]
    assert sliding_b[:2] == sliding[:2]


def test_no_prefix_cache_never_hits_and_still_keeps_two_tables() -> None:
    spec = PoolSpec(block_size=4, num_blocks=24)
    allocator = vllm_hybrid.kv_cache_manager_hybrid_no_prefix_cache(spec)
    allocator.admit("a", (), PROMPT)
    allocator.step_completed(0)
    assert allocator.admit("b", (), PROMPT + (1,)).num_cached_tokens == 0
    tables = allocator.group_block_tables("a") + allocator.group_block_tables("b")
    assert len(set(_in_tables(tables))) == 5 + 5 + 6 + 6 == spec.num_blocks - len(allocator.free_blocks())
    allocator.free("a")
    allocator.free("b")
    assert allocator.cached_blocks() == [] and sorted(allocator.free_blocks()) == list(range(spec.num_blocks))


def test_a_hybrid_factory_needs_its_window_and_drives_no_drafts_connector_or_deferred_frees() -> None:
    from kvfuzz.adapters.vllm_v1 import VllmOptions

    for options in (
        VllmOptions(),
        VllmOptions(sliding_window=8, speculative_tokens=2),
        VllmOptions(sliding_window=8, kv_connector=True),
        VllmOptions(sliding_window=8, inflight_window=1),
    ):
        with pytest.raises(ValueError):
            vllm_hybrid.VllmHybridAllocator(SPEC, options)


def test_a_hit_needs_only_the_window_the_next_token_reads() -> None:
    """The token after a hit of n reads positions n - w + 1 .. n, so vLLM keeps the sliding-window blocks of
    positions n - w + 1 .. n - 1 and maps the one before them to its null block; at block size 1 that is exactly
    one block less than [n - w, n), which kvfuzz's hybrid rule once demanded (a false invariant 9)."""
    from kvfuzz.engine import Engine
    from kvfuzz.statemachines import MachineConfig

    config = MachineConfig(block_size=1, num_blocks=64)
    engine = Engine(vllm_hybrid.kv_cache_manager_hybrid(config.pool_spec()), config)
    engine.admit("a", (), PROMPT[:9])
    engine.step()
    engine.free("a")
    engine.admit("b", (), PROMPT[:8] + (99,))  # a hit of 8 tokens: the next token, position 8, reads 1..8
    full, sliding = engine.allocator.group_block_tables("b")
    assert sliding[0] == NULL_BLOCK and NULL_BLOCK not in sliding[1:] + full
    assert engine.allocator.refcount(sliding[1]) == 1 and engine.expected.seqs["b"].table == full
    engine.step()


# -- groups of different block sizes ------------------------------------------------------------------------------


def test_groups_of_different_block_sizes_are_built_as_vllm_resolves_them() -> None:
    """Full attention in blocks of 4, the sliding window in blocks of 8: vLLM hashes in the smaller (its
    hash_block_size, gcd of the two), schedules in the larger (scheduler_block_size, their lcm); the adapter
    declares the sliding group's block size."""
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator

    allocator = vllm_hybrid.kv_cache_manager_hybrid_sliding_double(SPEC)
    coordinator = allocator._manager.coordinator
    assert type(coordinator) is HybridKVCacheCoordinator
    assert (coordinator.hash_block_size, coordinator.scheduler_block_size) == (4, 8)
    assert [manager.block_size for manager in coordinator.single_type_managers] == [4, 8]
    full, sliding = allocator.capabilities.kv_groups
    assert (full.block_size, sliding.block_size, sliding.sliding_window) == (None, 8, 16)


def test_each_group_table_holds_its_own_block_count() -> None:
    """20 tokens fill five 4-token blocks in the full-attention group and three 8-token blocks in the sliding one
    (the last half full), all distinct blocks of the one pool."""
    allocator = vllm_hybrid.kv_cache_manager_hybrid_sliding_double(SPEC)
    result = allocator.admit("a", (), PROMPT)
    full, sliding = allocator.group_block_tables("a")
    assert result.block_table == full and len(full) == 5 and len(sliding) == 3
    assert len(set(_in_tables((full, sliding)))) == 8 == SPEC.num_blocks - len(allocator.free_blocks())
    slots = allocator.grow("a", (99, 98)).slots  # grow's slots are group 0's, at its block size of 4
    full_after, sliding_after = allocator.group_block_tables("a")
    assert [(slot.block, slot.offset) for slot in slots] == [(full_after[5], 0), (full_after[5], 1)]
    assert len(sliding_after) == 3  # 22 tokens still fit three 8-token blocks


def test_a_hit_is_a_multiple_of_the_scheduler_block_size() -> None:
    """After a 16-token prompt, a 13-token prompt could hit 12 tokens in the full-attention group alone; vLLM
    aligns the hit to scheduler_block_size (8), so the sliding group's hit covers whole 8-token blocks. kvfuzz's
    machine checks the admission (the hit of 8 is sound and aligned)."""
    from kvfuzz.engine import Engine

    config = MachineConfig(block_size=4, num_blocks=32)
    engine = Engine(vllm_hybrid.kv_cache_manager_hybrid_sliding_double(config.pool_spec()), config)
    engine.admit("a", (), PROMPT[:16])
    engine.step()
    engine.free("a")
    engine.admit("b", (), PROMPT[:12] + (99,))
    assert engine.expected.seqs["b"].written == 8
    engine.admit("c", (), PROMPT[:16] + (99,))
    assert engine.expected.seqs["c"].written == 16
    engine.step()
    engine.quiesce()


class _GroupBlockSizeUndeclared(vllm_hybrid.VllmHybridAllocator):
    """A wrong shim: it builds the sliding group in 8-token blocks but declares it at the pool's block size."""

    def __init__(self, spec: PoolSpec) -> None:
        from kvfuzz.adapters.vllm_v1 import VllmOptions

        super().__init__(spec, VllmOptions(sliding_window=16), sliding_block_factor=2)
        full, sliding = self.capabilities.kv_groups
        self.capabilities = attrs.evolve(self.capabilities, kv_groups=(full, attrs.evolve(sliding, block_size=None)))


def test_a_shim_that_leaves_the_group_block_size_undeclared_is_caught() -> None:
    """kvfuzz then expects five sliding-window blocks for 20 tokens and finds vLLM's three."""
    from kvfuzz.engine import Engine, Invariant, InvariantViolation

    config = MachineConfig(block_size=4, num_blocks=16)
    engine = Engine(_GroupBlockSizeUndeclared(config.pool_spec()), config)
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("a", (), PROMPT)
    assert caught.value.invariant is Invariant.REFCOUNTS
    assert "holds 3 block(s) for 20 tokens" in caught.value.summary
