"""Chunked local attention under vLLM's real v1 Scheduler (docs/scheduler-models.md#chunked-local-attention): a Llama 4
text model, a layer of chunked local attention beside one of full attention, two KV-cache groups over one pool. The
unmodified scheduler passes with the chunked group's drops and its prefix-cache hits reached; the worker's rule
reads each token's own chunk; each bug seeded into vLLM's chunked-local manager is caught.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import attrs
import pytest
from vllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec

from engine_tests.vllm_seeded_runs import first_violation, found_and_replayed, shared_prefix_programs
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.groups import GroupRule
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.violations import Check, SchedulerViolation
from kvfuzz.scheduler.vllm_build import kv_cache_config

CHUNKED = SchedulerSetup(num_blocks=24, block_size=2, model="chunked-local")  # chunks of 4 tokens
PREFIX = [1, 2, 3, 0, 2, 2, 1, 3]


def run_examples(setup: SchedulerSetup, examples: int) -> tuple[int, int]:
    """Random request programs with shared prefixes, each drained: the most null entries the chunked group's table
    held for one request, and the longest prefix-cache hit."""
    chunked = lambda session: [rule.index for rule in session.worker.groups if rule.chunk is not None]  # noqa: E731
    nulled, hits = shared_prefix_programs(setup, examples, PREFIX, 0.35, 4, 6, chunked)
    return max(nulled.values(), default=0), hits


def first_failure(setup: SchedulerSetup = CHUNKED, examples: int = 30) -> SchedulerViolation:
    return first_violation(lambda: run_examples(setup, examples))


def test_vllm_plans_a_chunked_local_group_beside_a_full_attention_group_in_one_pool() -> None:
    config = kv_cache_config(CHUNKED)
    specs = sorted(type(group.kv_cache_spec).__name__ for group in config.kv_cache_groups)
    assert specs == [ChunkedLocalAttentionSpec.__name__, FullAttentionSpec.__name__]
    session = Session(CHUNKED)
    assert type(session.scheduler.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    assert sorted(rule.chunk or 0 for rule in session.worker.groups) == [0, 4]
    # vLLM's startup check admits the longest request: its full-attention blocks and a chunk and a budget's in flight
    assert CHUNKED.max_model_len == 2 * (24 - -(-(4 + 16) // 2))


def test_a_token_attends_its_own_chunk() -> None:
    rule = GroupRule(1, None, chunk=4)
    assert [rule.first_needed(position) for position in range(10)] == [0, 0, 0, 0, 4, 4, 4, 4, 8, 8]
    assert not rule.reads_all and GroupRule(0, None).reads_all
    assert "chunked local attention of 4 tokens" in rule.describe()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_unmodified_scheduler_passes_with_drops_and_hits_reached(async_scheduling: bool) -> None:
    nulled, hits = run_examples(attrs.evolve(CHUNKED, async_scheduling=async_scheduling), 10)
    assert nulled > 0 and hits > 0, (nulled, hits)


# -- bugs seeded into vLLM's chunked-local manager --------------------------------------------------------------------


def skips_into_the_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the manager frees a block more than the tokens left of the current chunk (the chunk's first block
    too, while the next token still attends it)."""
    original = ChunkedLocalAttentionManager.get_num_skipped_tokens

    def skipped(self: Any, num_computed_tokens: int) -> int:
        return min(original(self, num_computed_tokens) + self.block_size, num_computed_tokens)

    monkeypatch.setattr(ChunkedLocalAttentionManager, "get_num_skipped_tokens", skipped)


def hit_nulls_the_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a prefix-cache hit hands over the first block of the hit's last chunk as the null block (as if it
    were out of the window), though the next token attends it."""
    original = ChunkedLocalAttentionManager.find_longest_cache_hit.__func__  # type: ignore[attr-defined]
    signature = inspect.signature(original)

    def find(cls: Any, *args: Any, **kwargs: Any) -> Any:
        computed, length = original(cls, *args, **kwargs)
        bound = signature.bind(cls, *args, **kwargs).arguments
        spec, pool, max_length = bound["kv_cache_spec"], bound["block_pool"], bound["max_length"]
        start = max_length // spec.attention_chunk_size * spec.attention_chunk_size // spec.block_size
        for blocks in computed:
            if start < len(blocks) and not blocks[start].is_null:
                blocks[start] = pool.null_block
        return computed, length

    monkeypatch.setattr(ChunkedLocalAttentionManager, "find_longest_cache_hit", classmethod(find))


def test_a_drop_into_the_current_chunk_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block freed is still in the request's table, which the worker reads: the accounting check sees it free
    while a running request's table holds it."""
    skips_into_the_chunk(monkeypatch)
    failure = first_failure()
    assert failure.check == Check.ACCOUNTING and "is in the free queue" in str(failure), failure


def test_a_hit_that_nulls_an_attended_block_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    hit_nulls_the_chunk(monkeypatch)
    failure = first_failure()
    assert (failure.check, failure.cause) == (Check.CONTENT, "a position mapped to the null block"), failure
    assert "chunked local attention of 4 tokens" in str(failure), failure


def test_a_seeded_bug_is_found_by_a_run_and_its_trace_replays(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvfuzz run --model chunked-local`` finds the manager's early drop, and its trace replays word for word."""
    skips_into_the_chunk(monkeypatch)
    options = ["--model", "chunked-local", "--num-blocks", "24", "--block-size", "2"]
    trace = found_and_replayed(capsys, tmp_path / "corpus", options, {Check.ACCOUNTING}, "in the free queue")
    assert trace.setup.model == "chunked-local"
