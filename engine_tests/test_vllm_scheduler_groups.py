"""Several KV-cache groups of one kind under vLLM's real v1 Scheduler (docs/scheduler-models.md#several-groups-of-one-
kind): a Gemma 2 of two sliding-window layers and one full-attention layer, which vLLM's planner splits into three
groups over one pool, two of one sliding-window spec that its hybrid coordinator looks up together. The unmodified
scheduler passes with both sliding-window groups' drops and their prefix-cache hits reached; a lookup that hands one
group's hit to the other is caught, and so is a drop into the window of either group.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import attrs
import pytest
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from engine_tests.vllm_seeded_runs import first_violation, found_and_replayed, shared_prefix_programs
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.violations import Check, SchedulerViolation
from kvfuzz.scheduler.vllm_build import kv_cache_config

GROUPS = SchedulerSetup(num_blocks=40, block_size=2, model="sliding-window-groups")  # windows of 4 tokens
PREFIX = [1, 2, 3, 0, 2, 2, 1, 3, 0, 1]


def sliding_groups(session: Session) -> list[int]:
    return [rule.index for rule in session.worker.groups if rule.window is not None]


def run_examples(setup: SchedulerSetup, examples: int) -> tuple[dict[int, int], int]:
    """Random request programs with shared prefixes, each drained: per sliding-window group, the most null entries
    its table held for one request; and the longest prefix-cache hit."""
    return shared_prefix_programs(setup, examples, PREFIX, 0.4, 4, 6, sliding_groups)


def first_failure(examples: int = 30) -> SchedulerViolation:
    return first_violation(lambda: run_examples(GROUPS, examples))


def test_vllm_plans_three_groups_two_of_one_sliding_window_spec_looked_up_together() -> None:
    config = kv_cache_config(GROUPS)
    assert config.num_blocks == GROUPS.num_blocks + 1
    kinds = [type(group.kv_cache_spec).__name__ for group in config.kv_cache_groups]
    assert sorted(kinds) == [FullAttentionSpec.__name__, SlidingWindowSpec.__name__, SlidingWindowSpec.__name__]
    session = Session(GROUPS)
    coordinator = session.scheduler.kv_cache_manager.coordinator
    assert type(coordinator).__name__ == "HybridKVCacheCoordinator"
    # the two sliding-window groups are one lookup group of the coordinator's (one spec, one manager class, one pool)
    lookups = {manager.__name__: ids for _, ids, manager, _ in coordinator.attention_groups}
    assert lookups["SlidingWindowManager"] == sliding_groups(session) and len(lookups["SlidingWindowManager"]) == 2
    assert sorted(rule.window or 0 for rule in session.worker.groups) == [0, 4, 4]
    # vLLM's startup check admits the longest request: 18 blocks of full attention, 11 of each window
    assert GROUPS.max_model_len == 36


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_unmodified_scheduler_passes_with_both_groups_drops_and_hits_reached(async_scheduling: bool) -> None:
    nulled, hits = run_examples(attrs.evolve(GROUPS, async_scheduling=async_scheduling), 10)
    assert len(nulled) == 2 and min(nulled.values()) > 0 and hits > 0, (nulled, hits)


# -- bugs seeded into vLLM's sliding-window manager ------------------------------------------------------------------


def hit_of_the_first_group_for_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the lookup of the two sliding-window groups together returns the first group's hit blocks for
    both (the blocks of one layer's K/V handed to the other layer)."""
    original = SlidingWindowManager.find_longest_cache_hit.__func__  # type: ignore[attr-defined]

    def find(cls: Any, *args: Any, **kwargs: Any) -> Any:
        computed, length = original(cls, *args, **kwargs)
        if len(computed) > 1:
            computed = tuple(list(computed[0]) for _ in computed)
        return computed, length

    monkeypatch.setattr(SlidingWindowManager, "find_longest_cache_hit", classmethod(find))


def second_group_drops_into_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the second sliding-window group frees a block more than its window allows (the first group keeps
    the right number)."""
    original = SlidingWindowManager.get_num_skipped_tokens
    signature = inspect.signature(original)
    assert list(signature.parameters) == ["self", "num_computed_tokens"], signature

    def skipped(self: Any, num_computed_tokens: int) -> int:
        extra = self.block_size if self.kv_cache_group_id == max(GROUP_IDS) else 0
        return min(original(self, num_computed_tokens) + extra, num_computed_tokens)

    monkeypatch.setattr(SlidingWindowManager, "get_num_skipped_tokens", skipped)


GROUP_IDS = [
    index for index, group in enumerate(kv_cache_config(GROUPS).kv_cache_groups) if group.kv_cache_spec.sliding_window
]


def test_a_hit_handed_to_the_wrong_group_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    hit_of_the_first_group_for_both(monkeypatch)
    failure = first_failure()
    assert failure.check == Check.CONTENT, failure
    # the message names both groups: the one whose K/V the position should hold, the one whose it holds
    expected, found = str(failure).split("but holds")
    assert f"in kv-cache group {max(GROUP_IDS)}" in expected and f"in kv-cache group {min(GROUP_IDS)}" in found, failure


def test_a_drop_into_the_second_group_s_window_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    second_group_drops_into_the_window(monkeypatch)
    failure = first_failure()
    assert failure.check == Check.ACCOUNTING and "is in the free queue" in str(failure), failure


def test_a_seeded_bug_is_found_by_a_run_and_its_trace_replays(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvfuzz run --model sliding-window-groups`` finds the wrong group's hit, and its trace replays word for
    word."""
    hit_of_the_first_group_for_both(monkeypatch)
    options = ["--model", "sliding-window-groups", "--num-blocks", "40", "--block-size", "2"]
    trace = found_and_replayed(capsys, tmp_path / "corpus", options, {Check.CONTENT}, "group")
    assert trace.setup.model == "sliding-window-groups"
