"""vLLM v0's block manager behind kvfuzz (kvfuzz.adapters.vllm_v0).

Runs in its own environment (``scripts/third_party_env.sh vllm-v0``; CI runs it there): without vLLM 0.10.2 the
import fails loudly rather than skipping.
"""

from __future__ import annotations

import os
import subprocess
import sys

import attrs
import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvfuzz.adapters.vllm_v0 import (
    block_space_manager,
    block_space_manager_chunked_prefill,
    block_space_manager_no_caching,
    block_space_manager_without_fork,
)
from kvfuzz.allocator import BlockCopy, OutOfBlocks, PoolSpec
from kvfuzz.engine import Engine
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.profiles import PROFILES
from kvfuzz.statemachines import MachineConfig, machine_for

SPEC = PoolSpec(block_size=4, num_blocks=16, num_host_blocks=4)


def test_without_prefix_caching_every_invariant_holds_under_ci() -> None:
    """Without a host pool: freeing a swapped-out sequence corrupts v0's block-object pools (a known bug, replayed
    by corpus/vllm-v0-free-swapped-block-pool-*), which a longer run would reach; swapping is checked below."""
    config = MachineConfig(num_host_blocks=0)
    run_state_machine_as_test(machine_for(block_space_manager_no_caching, config), settings=PROFILES["ci"])


def test_with_prefix_caching_as_its_engine_drives_it_every_invariant_holds_under_ci() -> None:
    """Prefix caching, blocks matchable when allocated (declared), FCFS preemption, no fork (the 0.10.2 engine
    never forks), no host pool (see above)."""
    config = MachineConfig(num_host_blocks=0)
    run_state_machine_as_test(machine_for(block_space_manager_without_fork, config), settings=PROFILES["ci"])


def test_with_prefix_caching_ci_finds_the_release_before_compute_hit() -> None:
    """The known vLLM v0 bug (see corpus/vllm-v0-*): a prompt's blocks released before its first step (a chunked
    prefill preempted part-way) are served as a cache hit. This fails the day the block manager, or the adapter,
    stops reproducing it. (No shrinking: the shrunk program is the corpus trace.)"""
    unshrunk = settings(PROFILES["ci"], phases=[phase for phase in Phase if phase is not Phase.shrink])
    with pytest.raises(InvariantViolation) as caught:
        run_state_machine_as_test(machine_for(block_space_manager_chunked_prefill, MachineConfig()), settings=unshrunk)
    assert caught.value.invariant.number == 9


def test_grow_into_a_forked_tail_returns_the_copy_on_write_pair() -> None:
    manager = block_space_manager_no_caching(SPEC)
    (shared,) = manager.admit("a", (), (1, 2)).block_table
    manager.step_completed(0)
    manager.fork("a", "b")
    result = manager.grow("a", (3,))
    (private,) = manager.block_table("a")
    assert private != shared and manager.block_table("b") == (shared,)
    assert result.copies == (BlockCopy(src=shared, dst=private),)
    assert [(slot.block, slot.offset) for slot in result.slots] == [(private, 2)]
    assert manager.refcount(shared) == manager.refcount(private) == 1


def test_swap_maps_device_blocks_to_host_blocks_and_back() -> None:
    manager = block_space_manager_no_caching(SPEC)
    table = manager.admit("a", (), tuple(range(6))).block_table
    manager.step_completed(0)
    out = manager.swap_out("a").mapping
    assert sorted(device for device, _ in out) == sorted(table)
    assert all(0 <= host < SPEC.num_host_blocks for _, host in out)
    back = manager.swap_in("a").mapping
    assert sorted(host for host, _ in back) == sorted(host for _, host in out)
    assert sorted(device for _, device in back) == sorted(manager.block_table("a"))


def test_the_host_free_set_follows_swaps_and_the_engine_checks_it() -> None:
    """host_free_blocks() reads the host allocator's free list, numbered as the swap mappings number host blocks."""
    manager = block_space_manager_no_caching(SPEC)
    assert sorted(manager.host_free_blocks()) == [0, 1, 2, 3]
    engine = Engine(manager, MachineConfig(num_host_blocks=SPEC.num_host_blocks))
    assert engine.checks.host_introspection is manager
    engine.admit("a", (), tuple(range(6)))
    engine.step()
    assert engine.swap_out("a")
    held = set(engine.expected.seqs["a"].host_table)
    assert len(held) == 2 and set(manager.host_free_blocks()) == {0, 1, 2, 3} - held
    assert engine.swap_in("a")
    assert sorted(manager.host_free_blocks()) == [0, 1, 2, 3]
    engine.quiesce()


def _forks_decode(manager) -> Engine:
    """``admit(s0, 23 tokens); step(); fork(s0, s1); fork(s1, s2); decode()`` at block size 8 (the campaign's
    program): s0's append copies the shared tail (block 2) into block 3; s1's copies it into block 4, then, the block
    being full, v0 finds block 3 with the same content, maps it and frees block 4 with the copy 2 -> 4 ordered."""
    engine = Engine(manager, MachineConfig(block_size=8, num_blocks=16, num_host_blocks=0))
    engine.admit("s0", (), tuple(range(23)))
    engine.step()
    engine.fork("s0", "s1")
    engine.fork("s1", "s2")
    for seq in ("s0", "s1", "s2"):
        assert engine.grow(seq, (7,))
    return engine


def test_a_copy_on_write_deduplicated_against_an_identical_full_block_is_declared_and_accepted() -> None:
    manager = block_space_manager(PoolSpec(8, 16, 0))
    assert manager.capabilities.dedupes_copied_tail
    engine = _forks_decode(manager)
    assert engine.stats["copy-on-write copies deduplicated"] == 1
    tables = {seq: manager.block_table(seq) for seq in ("s0", "s1", "s2")}
    assert tables["s0"][2] == tables["s1"][2] == tables["s2"][2], "each full tail deduplicated to one block"
    engine.step()
    engine.quiesce()


def test_without_dedupes_copied_tail_the_wasted_copy_is_reported() -> None:
    manager = block_space_manager(PoolSpec(8, 16, 0))
    manager.capabilities = attrs.evolve(manager.capabilities, dedupes_copied_tail=False)
    with pytest.raises(InvariantViolation) as caught:
        _forks_decode(manager)
    assert caught.value.invariant is Invariant.EXCLUSIVE_WRITES
    assert "copy-on-write copy from block 2 into block 4 while it is shared" in caught.value.summary


def _swap_twins(manager) -> Engine:
    """Two requests with the same 6-token prompt, each computed and swapped out: v0's host allocator maps the
    second's full block to the host block the first holds with the same content."""
    engine = Engine(manager, MachineConfig(block_size=4, num_blocks=16, num_host_blocks=8))
    for seq in ("a", "b"):
        engine.admit(seq, (), tuple(range(6)))
        engine.step()
        assert engine.swap_out(seq)
    return engine


def test_a_host_block_shared_at_swap_out_is_declared_and_checked() -> None:
    manager = block_space_manager(PoolSpec(4, 16, 8))
    assert manager.capabilities.shares_host_blocks
    assert not block_space_manager_no_caching(PoolSpec(4, 16, 8)).capabilities.shares_host_blocks
    engine = _swap_twins(manager)
    shared = engine.expected.seqs["a"].host_table[0]
    assert engine.expected.seqs["b"].host_table[0] == shared
    assert engine.stats["host blocks shared at swap-out"] == 1
    assert engine.swap_in("a")
    assert shared not in manager.host_free_blocks(), "b still holds it"
    engine.step()
    assert engine.swap_in("b")
    engine.step()
    engine.quiesce()


def test_without_shares_host_blocks_the_shared_host_block_is_reported() -> None:
    manager = block_space_manager(PoolSpec(4, 16, 8))
    manager.capabilities = attrs.evolve(manager.capabilities, shares_host_blocks=False)
    with pytest.raises(InvariantViolation) as caught:
        _swap_twins(manager)
    assert caught.value.invariant is Invariant.CONTENT
    assert "swap-out of b reuses host block(s) [0]" in caught.value.summary


def test_refusals_leave_the_block_manager_as_it_was() -> None:
    manager = block_space_manager_no_caching(SPEC)
    manager.admit("a", (), tuple(range(4 * 15)))
    with pytest.raises(OutOfBlocks):
        manager.admit("b", (), tuple(range(8)))
    with pytest.raises(OutOfBlocks):
        manager.grow("a", tuple(range(8)))
    assert len(manager.block_table("a")) == 15 and len(manager.free_blocks()) == 1
    assert len(manager.grow("a", (7,)).slots) == 1 and len(manager.block_table("a")) == 16


def test_cache_hits_count_computed_blocks_only_and_a_full_hit_recomputes_one_token() -> None:
    manager = block_space_manager(SPEC)
    prompt = (1, 2, 3, 0, 1, 2, 3, 0)
    first = manager.admit("a", (), prompt)
    assert first.num_cached_tokens == 0
    assert manager.admit("b", (), prompt + (5,)).num_cached_tokens == 0, "not computed before step 0 completes"
    manager.step_completed(0)
    assert manager.admit("c", (), prompt + (6,)).num_cached_tokens == 8
    full = manager.admit("d", (), prompt)
    assert full.num_cached_tokens == 7 and full.block_table == first.block_table


def test_namespaces_are_lora_adapters_and_do_not_share_blocks() -> None:
    manager = block_space_manager(SPEC)
    prompt = (1, 2, 3, 0, 1)
    manager.admit("a", ("lora-7",), prompt)
    manager.step_completed(0)
    assert manager.admit("b", ("lora-7",), prompt).num_cached_tokens == 4
    assert manager.admit("c", ("ab", "c"), prompt).num_cached_tokens == 0
    assert manager.admit("d", (), prompt).num_cached_tokens == 0


def test_the_engine_watermark_is_declared_as_reserved_blocks() -> None:
    assert block_space_manager_no_caching(SPEC).capabilities.reserved_blocks == 0
    assert block_space_manager(PoolSpec(4, 250, 0)).capabilities.reserved_blocks == 2


def test_the_timeline_names_the_library_blocks(tmp_path) -> None:
    """``kvfuzz show`` replays the corpus trace here and labels every device lane with the library's own id
    (vLLM v0 numbers blocks as the contract does)."""
    from pathlib import Path

    from kvfuzz.saved.trace import load
    from kvfuzz.timeline.html import render_html
    from kvfuzz.timeline.record import record

    corpus = Path(__file__).resolve().parent.parent / "corpus"
    path = corpus / "vllm-v0-free-swapped-block-pool-indexerror-ad1d6ca8ad9b.json"
    timeline = record(load(path), str(path))
    assert timeline.outcome.verdict == "reproduced"
    device = [lane for lane in timeline.lanes if lane.pool == "device"]
    assert device
    for lane in device:
        assert lane.library_name == f"vLLM v0 block {lane.block}"
    page = render_html(timeline)
    assert all(lane.library_name in page for lane in device)


_BLOCK_HASHES = """
from kvfuzz.adapters.vllm_v0 import block_space_manager
from kvfuzz.allocator import PoolSpec

manager = block_space_manager(PoolSpec(block_size=2, num_blocks=8))
manager.admit("s0", (), (1, 2, 3, 0, 1))
manager.admit("s1", ("lora",), (1, 2, 3, 0, 1))
tables = manager._manager.block_tables
blocks = [block for request in manager._live.values() for block in tables[request.seq.seq_id].blocks]
print([block.content_hash for block in blocks if block.is_full])
"""


def test_block_hashes_are_the_same_in_every_process() -> None:
    """vLLM draws its hashes per process (``hash('None')``, and ``None`` hashed by address); the adapter pins them,
    so that a program replays the same way in a fresh process, whatever its hash seed."""
    printed = set()
    for seed in ("0", "1", "2"):
        result = subprocess.run(
            [sys.executable, "-c", _BLOCK_HASHES],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        printed.add(result.stdout.strip().splitlines()[-1])
    assert len(printed) == 1, printed
    hashes = next(iter(printed)).strip("[]").split(", ")
    assert len(hashes) == 4 and all(int(value) for value in hashes)  # each full block of both prompts, hashed


def test_an_allocator_campaign_s_coverage_measures_vllm_v0_s_block_manager() -> None:
    from kvfuzz.coverage.scope import KVFUZZ, allocator_scope
    from kvfuzz.registry import load_factory

    files = allocator_scope(load_factory("kvfuzz.adapters.vllm_v0:block_space_manager")).files()
    assert any(file.endswith("vllm/core/block_manager.py") for file in files), files
    assert any(file.endswith("vllm/core/block/block_table.py") for file in files), files
    assert not any(file.startswith(KVFUZZ) for file in files) and not any(
        file.endswith("scheduler.py") for file in files
    )
