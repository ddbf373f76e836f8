"""SGLang imported lazily for the scheduler target, and the pieces its ``Scheduler`` owns built on CPU without a
model: the paged token pool, the ``ReqToTokenPool``, the ``UnifiedRadixCache`` that SGLang 0.5.23's cache factory
builds for a full-attention model (``disable`` with prefix caching off), the ``SchedulePolicy``, and the stand-in
for the model configuration ``ScheduleBatch`` reads (its vocabulary size, and that it is not an encoder-decoder)."""

from __future__ import annotations

import functools
import importlib.util
import types
from typing import Any, Optional

import attrs
import torch

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.fake_model import VOCABULARY


def sglang_missing() -> bool:
    """Whether SGLang cannot be imported here."""
    return importlib.util.find_spec("sglang") is None


def setup_problem(setup: SchedulerSetup) -> Optional[str]:
    """The one line a configuration SGLang's paged pool cannot serve is refused with."""
    if setup.block_size < 2:
        return "--scheduler sglang needs --block-size >= 2 (SGLang serves page size 1 with another allocator)"
    if setup.max_num_batched_tokens % setup.block_size:
        return (
            f"--scheduler sglang needs --max-num-batched-tokens ({setup.max_num_batched_tokens}) divisible by "
            f"--block-size ({setup.block_size}): SGLang's server arguments refuse a chunked_prefill_size that is not"
        )
    if setup.prefix_resets or setup.kv_events or setup.overlong_requests or setup.stats:
        return (
            "--scheduler sglang drives no prefix-cache resets, KV cache events, requests past max_model_len or "
            "scheduler stats (yet)"
        )
    if setup.prefix_match_unit:
        return "--scheduler sglang drives no partial prefix caching (prefix_match_unit; yet)"
    if setup.sessions:
        return "--scheduler sglang drives no resumable requests (sessions) (yet)"
    if setup.pauses:
        return "--scheduler sglang drives no pauses (yet)"
    if setup.long_prefill_token_threshold or setup.max_num_active_seqs or setup.prefill_schedule_interval > 1:
        return (
            "--scheduler sglang takes no vLLM long_prefill_token_threshold, max_num_active_seqs or "
            "prefill_schedule_interval"
        )
    return None


@functools.lru_cache(maxsize=None)
def sglang() -> types.SimpleNamespace:
    """SGLang's scheduler classes, imported once (the allocator adapter's import, with its torchvision stand-in and
    its runtime context)."""
    from kvfuzz.adapters.sglang._engine import sglang as memory_cache

    engine = memory_cache()
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return types.SimpleNamespace(
        engine=engine,
        Req=Req,
        ScheduleBatch=ScheduleBatch,
        FINISH_ABORT=FINISH_ABORT,
        AddReqResult=AddReqResult,
        PrefillAdder=PrefillAdder,
        SchedulePolicy=SchedulePolicy,
        UnifiedRadixCache=UnifiedRadixCache,
        FULL=ComponentType.FULL,
        no_speculation=SpeculativeAlgorithm.NONE,
    )


@attrs.frozen
class ModelStandIn:
    """What ``ScheduleBatch`` reads of the model configuration on the paths driven here."""

    vocab_size: int = VOCABULARY
    is_encoder_decoder: bool = False
    hf_text_config: Any = None


@attrs.frozen
class Pools:
    """The KV-cache pieces one example's scheduler loop owns, built as SGLang's ``Scheduler`` builds them (page size
    = block size; pages ``1 .. num_blocks`` allocatable, page 0 the padding page)."""

    token_pool: Any  # PagedTokenToKVPoolAllocator
    req_to_token_pool: Any  # ReqToTokenPool
    tree_cache: Any  # UnifiedRadixCache, disabled with prefix caching off
    policy: Any  # SchedulePolicy


def new_pools(setup: SchedulerSetup) -> Pools:
    """Fresh pools for ``setup``; call with SGLang's runtime context active."""
    api = sglang()
    engine = api.engine
    page = setup.block_size
    token_pool = engine.PagedTokenToKVPoolAllocator(
        setup.num_blocks * page, page_size=page, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False
    )
    req_to_token_pool = engine.ReqToTokenPool(
        size=setup.max_num_seqs + 1,  # running requests and the chunked one
        max_context_len=setup.max_model_len + page,
        device="cpu",
        enable_memory_saver=False,
    )
    params = engine.CacheInitParams(
        disable=not setup.prefix_caching,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=token_pool,
        page_size=page,
    )
    params.tree_components = (api.FULL,)  # a full-attention model, as create_unified_radix_cache builds it
    tree_cache = api.UnifiedRadixCache(params)
    policy = api.SchedulePolicy(
        "lpm" if setup.prefix_caching else "fcfs",
        tree_cache,
        enable_hierarchical_cache=False,
        enable_priority_scheduling=False,
        schedule_low_priority_values_first=False,
    )
    return Pools(token_pool, req_to_token_pool, tree_cache, policy)
