"""A vLLM bug (0.33.0 and 0.34.0) met while building kvfuzz's P/D connector for the Mamba hybrid, and reproduced
without kvfuzz's connector or checks: vLLM's own ``DecodeBenchConnector`` (it supports the hybrid allocator, and
loads every prompt token but the last synchronously) on a Mamba hybrid with prefix caching crashes the scheduler.
``allocate_slots`` passes its capacity check, then ``BlockPool.get_new_blocks`` raises ``ValueError: Cannot get 1
free blocks from the pool``: in align mode ``MambaManager.get_num_blocks_to_allocate`` caps the Mamba group's new
blocks at one, but a request admitted with a synchronous load and a new token in the same step takes two (the
loaded state's block, taken by ``allocate_external_computed_blocks``, and the running state's). A bare scheduler loop
(random prompts, a trivial model output) meets it; the full-attention model, the hybrid without prefix caching, and
the hybrid with that count raised by one pass the same loop.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there): without vLLM the import fails
loudly rather than skipping."""

from __future__ import annotations

import dataclasses
import random
import traceback
from typing import Any, Iterator, Optional

import pytest
import vllm.v1.core.single_type_kv_cache_manager as single_type
from vllm.config import KVTransferConfig
from vllm.v1.outputs import ModelRunnerOutput

import kvfuzz.scheduler.vllm_build as vllm_build
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.vllm_build import new_request, new_scheduler

HYBRID = SchedulerSetup(model="mamba-hybrid", block_size=4, num_blocks=16, max_num_seqs=5)
"""A Mamba hybrid with prefix caching (align mode); max_num_seqs set apart from other tests' setups, whose built
configurations are cached per setup."""

INDEX = "req_id_to_index" in {field.name for field in dataclasses.fields(ModelRunnerOutput)}
"""Whether this release's ModelRunnerOutput takes req_id_to_index (0.33.0's does, 0.34.0's does not)."""


@pytest.fixture
def decode_bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """vLLM's DecodeBenchConnector as the scheduler's KV connector (the configurations built meanwhile forgotten
    after, so no other test gets it)."""
    connector = KVTransferConfig(kv_connector="DecodeBenchConnector", kv_role="kv_both")
    monkeypatch.setattr(vllm_build, "_kv_transfer_config", lambda setup: connector)
    vllm_build._built_config.cache_clear()
    vllm_build.kv_cache_config.cache_clear()
    yield
    vllm_build._built_config.cache_clear()
    vllm_build.kv_cache_config.cache_clear()


def first_error(setup: SchedulerSetup, trials: int = 40, seed: int = 1) -> Optional[ValueError]:
    """Run ``trials`` fresh schedulers of ``setup``, each 60 steps of random arrivals (prompts of 1 to 12 tokens, 1 to
    4 outputs) under a trivial model output; the first ``ValueError`` vLLM raises, or None."""
    rng = random.Random(seed)
    for _ in range(trials):
        scheduler = new_scheduler(setup)
        assert type(scheduler.connector).__name__ == "DecodeBenchConnector"
        added = 0
        for _ in range(60):
            for _ in range(rng.choice((0, 0, 1, 2))):
                prompt = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
                scheduler.add_request(new_request(f"r{added}", prompt, rng.randint(1, 4), setup.hash_block_size, added))
                added += 1
            try:
                output = scheduler.schedule()
            except ValueError as error:
                return error
            order, sampled = [], []
            for request, count in output.num_scheduled_tokens.items():
                held = scheduler.requests[request]
                order.append(request)
                sampled.append([0] if held.num_computed_tokens + count >= held.num_tokens else [])
            index: dict[str, Any] = {"req_id_to_index": {r: i for i, r in enumerate(order)}} if INDEX else {}
            scheduler.update_from_output(output, ModelRunnerOutput(req_ids=order, sampled_token_ids=sampled, **index))
    return None


def test_vllm_s_decode_bench_connector_crashes_the_mamba_hybrid_s_scheduler(decode_bench: None) -> None:
    error = first_error(HYBRID)
    assert error is not None and "Cannot get 1 free blocks from the pool" in str(error)
    frames = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    assert "allocate_slots" in frames and "get_new_blocks" in frames, frames


@pytest.mark.parametrize(
    "setup",
    [
        SchedulerSetup(model="full", block_size=4, num_blocks=16, max_num_seqs=5),
        SchedulerSetup(model="mamba-hybrid", block_size=4, num_blocks=16, max_num_seqs=5, prefix_caching=False),
    ],
    ids=["full-attention", "hybrid-without-prefix-caching"],
)
def test_the_same_loop_passes_elsewhere(decode_bench: None, setup: SchedulerSetup) -> None:
    assert first_error(setup) is None


def test_the_same_loop_passes_with_the_mamba_count_raised(decode_bench: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cause taken away: the align-mode Mamba count includes the loaded state's block for a request admitted with
    external tokens (its first allocation)."""
    count = single_type.MambaManager.get_num_blocks_to_allocate

    def counted(
        self: Any,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Any,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        **kwargs: Any,
    ) -> int:
        blocks = count(
            self,
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            **kwargs,
        )
        external = total_computed_tokens > num_local_computed_tokens and not self.req_to_blocks.get(request_id)
        refused = blocks > self.block_pool.num_gpu_blocks  # vLLM's "not this step" sentinel stays as it is
        return blocks + 1 if external and self.mamba_cache_mode == "align" and not refused else blocks

    monkeypatch.setattr(single_type.MambaManager, "get_num_blocks_to_allocate", counted)
    assert first_error(HYBRID) is None
