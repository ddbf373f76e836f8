"""kvfuzz's P/D-disaggregation connector on the Mamba hybrid (docs/scheduler-connectors.md#the-pd-connector): a
connector that supports vLLM's hybrid allocator and completes divergent local hybrid hits, as NIXL's does, so that
vLLM's scheduler looks its local hits up group by group (``get_computed_blocks_for_connector``,
``find_longest_cache_hit_per_group``), trims a partial local tail a longer remote hit supersedes
(``truncate_computed_blocks``), and hands the connector every group's blocks of a finished request. The unmodified
scheduler passes with those paths reached; each bug seeded into vLLM is caught by the check it breaks.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there)."""

from __future__ import annotations

import collections
from typing import Any

import attrs
import pytest
from test_vllm_scheduler_consumer import failed_receive_ignored, run_examples, seeded_bugs_caught
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator, KVCacheCoordinator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.pd_connector import KvfuzzPDConnector
from kvfuzz.scheduler.violations import Check

HYBRID = SchedulerSetup(
    num_blocks=12, block_size=2, kv_connector="pd", transfer_delay=2, model="mamba-hybrid", prefix_caching=True
)
PARTIAL = attrs.evolve(HYBRID, num_blocks=10, block_size=4, prefix_match_unit=1)  # hits end on any token
NO_CACHING = attrs.evolve(HYBRID, prefix_caching=False)  # one state block per request (mamba_cache_mode "none")
ASYNC = attrs.evolve(HYBRID, async_scheduling=True)  # two batches in flight: vLLM's deferred frees
ASYNC_PARTIAL = attrs.evolve(PARTIAL, async_scheduling=True)  # block copies whose ends vLLM retains for the step
FAILING = attrs.evolve(HYBRID, load_failures=True)  # failed loads: whole only, vLLM takes them by request here
FAILING_FAIL = attrs.evolve(FAILING, load_failure_policy="fail")


def counting(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Counts the calls of vLLM's hybrid connector paths, and the local hits ``get_computed_blocks_for_connector``
    found diverged (the full-attention group's deeper than the Mamba group's)."""
    calls: collections.Counter[str] = collections.Counter()

    def wrap(owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            calls[name] += 1
            calls["diverged"] += name == "get_computed_blocks_for_connector" and bool(result[3])
            return result

        monkeypatch.setattr(owner, name, counted)

    wrap(KVCacheManager, "get_computed_blocks_for_connector")
    wrap(KVCacheManager, "truncate_computed_blocks")
    wrap(HybridKVCacheCoordinator, "find_longest_cache_hit_per_group")
    return calls


def test_the_unmodified_scheduler_passes_with_divergent_hits_completed_by_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = counting(monkeypatch)
    tally = run_examples(HYBRID, 8)
    assert tally.loads > 0 and tally.sends > 0 and tally.sync_loads == 0, tally  # every load async on a hybrid
    assert calls["find_longest_cache_hit_per_group"] > 0 and calls["diverged"] > 0, calls


def test_the_unmodified_scheduler_passes_with_partial_local_tails_superseded(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counting(monkeypatch)
    tally = run_examples(PARTIAL, 8)
    assert tally.loads > 0 and calls["truncate_computed_blocks"] > 0, (tally, calls)


@pytest.mark.parametrize("setup", [NO_CACHING, ASYNC, ASYNC_PARTIAL], ids=["no-caching", "async", "async-partial"])
def test_the_unmodified_scheduler_passes(setup: SchedulerSetup) -> None:
    """Without prefix caching; and under async scheduling, where a Mamba group's earlier state block goes back to the
    pool at once as the state moves on (a later step runs after the one in flight), a finished request's blocks only
    once the steps in flight returned, and a block copy's ends once its step did."""
    tally = run_examples(setup, 8)
    assert tally.loads > 0 and tally.sends > 0, tally
    assert (tally.deferred > 0) == setup.async_scheduling, tally


# -- bugs seeded into vLLM's scheduler ------------------------------------------------------------------------------


def diverged_hit_not_reconciled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: ``get_computed_blocks_for_connector`` never reports a diverged hit, so a request the connector
    loads nothing for resumes from the full-attention group's deeper hit, where its Mamba group holds no state."""
    original = KVCacheManager.get_computed_blocks_for_connector

    def lookup(self: Any, *args: Any, **kwargs: Any) -> Any:
        blocks, local, boundary, _ = original(self, *args, **kwargs)
        return blocks, local, boundary, False

    monkeypatch.setattr(KVCacheManager, "get_computed_blocks_for_connector", lookup)


def mamba_blocks_freed_before_the_send(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a finished request whose send the connector delays its free for has its Mamba group's blocks
    (the state the send reads among them) freed all the same; its attention blocks are kept."""
    original = Scheduler._free_request

    def free_request(self: Any, request: Any, delay_free_blocks: bool = False) -> Any:
        result = original(self, request, delay_free_blocks)
        if request.request_id in self.requests:  # kept for a send in flight: its Mamba blocks freed anyway
            coordinator = self.kv_cache_manager.coordinator
            for manager in coordinator.single_type_managers:
                if type(manager).__name__ == "MambaManager":
                    manager.free(request.request_id)
        return result

    monkeypatch.setattr(Scheduler, "_free_request", free_request)


def state_block_not_handed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the blocks vLLM hands the connector when it orders a load (``update_state_after_alloc``) lack each
    Mamba group's last block, the one the state after the load's last token lives in (a view taken before the Mamba
    group's new block was appended)."""

    class WithoutStateBlock:
        def __init__(self, blocks: Any, mamba: set[int]) -> None:
            self.blocks = blocks
            self.mamba = mamba

        def get_block_ids(self) -> tuple[list[int], ...]:
            ids = self.blocks.get_block_ids()
            return tuple(group[:-1] if index in self.mamba else group for index, group in enumerate(ids))

        def get_unhashed_block_ids_all_groups(self) -> Any:
            return self.blocks.get_unhashed_block_ids_all_groups()

    original = KvfuzzPDConnector.update_state_after_alloc

    def update_state_after_alloc(self: Any, request: Any, blocks: Any, num_external_tokens: int) -> None:
        groups = self._kv_cache_config.kv_cache_groups
        mamba = {index for index, group in enumerate(groups) if type(group.kv_cache_spec).__name__ == "MambaSpec"}
        original(self, request, WithoutStateBlock(blocks, mamba), num_external_tokens)

    monkeypatch.setattr(KvfuzzPDConnector, "update_state_after_alloc", update_state_after_alloc)


def partial_tail_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: ``truncate_computed_blocks`` returns the local hit untrimmed, so a remote hit that supersedes a
    partial local tail is loaded over a block the prefix cache shares."""
    monkeypatch.setattr(KVCacheManager, "truncate_computed_blocks", lambda self, blocks, computed: blocks)


def state_freed_on_the_optimistic_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug, the twin of the sliding window's in-flight window free: ``allocate_slots`` frees skipped blocks on
    the optimistic count of computed tokens (the steps in flight's included), so a Mamba group's state block a step
    in flight still reads goes back to the pool, and a load may fill it before that step ran."""
    allocate = KVCacheManager.allocate_slots
    remove = KVCacheCoordinator.remove_skipped_blocks
    allocating: list[Any] = []

    def allocate_slots(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        allocating.append(request)
        try:
            return allocate(self, request, *args, **kwargs)
        finally:
            allocating.pop()

    def remove_skipped_blocks(self: Any, request_id: str, processed: int, num_prompt_tokens: Any = None) -> None:
        if allocating and allocating[-1].request_id == request_id:
            processed += allocating[-1].num_in_flight_tokens
        remove(self, request_id, processed, num_prompt_tokens)

    monkeypatch.setattr(KVCacheManager, "allocate_slots", allocate_slots)
    monkeypatch.setattr(KVCacheCoordinator, "remove_skipped_blocks", remove_skipped_blocks)


test_a_seeded_vllm_bug_is_caught = seeded_bugs_caught(
    {
        "diverged-not-reconciled": (
            diverged_hit_not_reconciled,
            HYBRID,
            Check.CONTENT,
            "a Mamba state in the null block",
        ),
        "mamba-freed-before-send": (
            mamba_blocks_freed_before_the_send,
            HYBRID,
            Check.DELAYED_FREE,
            "a delayed free returned before its send",
        ),
        "partial-tail-kept": (partial_tail_kept, PARTIAL, Check.TRANSFER, "a load's block with a block hash"),
        "state-freed-early": (
            state_freed_on_the_optimistic_count,
            ASYNC,
            Check.DELAYED_FREE,
            "a load into a block a step in flight reads",
        ),
        "no-state-block": (
            state_block_not_handed_over,
            HYBRID,
            Check.TRANSFER,
            "a load's Mamba state without its block",
        ),
        "failed-receive-ignored": (
            failed_receive_ignored,
            FAILING,
            Check.CONTENT,
            "a block a failed connector load never filled",
        ),
    }
)


@pytest.mark.parametrize("setup", [FAILING, FAILING_FAIL], ids=["recompute", "fail"])
def test_failed_loads_on_the_hybrid_are_whole_and_the_unmodified_scheduler_recovers(
    monkeypatch: pytest.MonkeyPatch, setup: SchedulerSetup
) -> None:
    """Block ids are unique only within a group, so vLLM refuses block-level failures (``invalid_block_ids``) on a
    hybrid and takes them by request (``failed_recving``): every failed load is whole, and vLLM's recovery (recompute
    from nothing, or finish the request with an error) passes every check, the Mamba state's included."""
    handled: list[set[str]] = []
    original = Scheduler._handle_failed_recving

    def handle(self: Any, failed: set[str]) -> set[str]:
        handled.append(set(failed))
        return original(self, failed)

    monkeypatch.setattr(Scheduler, "_handle_failed_recving", handle)
    tally = run_examples(setup, 12)
    assert tally.loads > tally.failed_loads > 0, tally
    assert sum(map(len, handled)) == tally.failed_loads, (handled, tally)
