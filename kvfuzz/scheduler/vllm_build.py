"""Building vLLM's v1 ``Scheduler`` offline: a two-layer llama ``config.json`` kvfuzz writes itself (no hub, no
tokenizer, no GPU), a ``VllmConfig`` on the CPU device, and a ``KVCacheConfig`` of one full-attention group over the
configured pool. vLLM is imported here only, on first use.

The ``VllmConfig`` is the slow part (vLLM validates the model's architecture); it is built once per configuration
and kept, and every example gets a fresh ``Scheduler`` over it (milliseconds), so that an example replays the same
way whatever ran before it."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import tempfile
import types
from pathlib import Path
from typing import Any, Optional

from kvfuzz.scheduler.config import MODEL_SHAPE, SchedulerSetup


def vllm_missing() -> bool:
    """Whether vLLM cannot be found (checked without importing it)."""
    return importlib.util.find_spec("vllm") is None


@functools.lru_cache(maxsize=None)
def vllm() -> types.SimpleNamespace:
    """vLLM's modules the target drives, imported on first use (importing vLLM takes seconds)."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    # The block pool logs every prefix-cache reset at INFO; the configuration warns of a token budget that a step's
    # drafts fill (the small budgets the target draws on purpose), and the scheduler's of a token budget above what its
    # running requests could use, which a swarmed configuration may draw (vLLM accepts both).
    logging.getLogger("vllm.v1.core.block_pool").setLevel(logging.WARNING)
    logging.getLogger("vllm.config.vllm").setLevel(logging.ERROR)
    logging.getLogger("vllm.config.scheduler").setLevel(logging.ERROR)
    init_none_hash(sha256)
    return types.SimpleNamespace(
        torch=torch,
        CacheConfig=CacheConfig,
        DeviceConfig=DeviceConfig,
        ModelConfig=ModelConfig,
        SchedulerConfig=SchedulerConfig,
        SpeculativeConfig=SpeculativeConfig,
        VllmConfig=VllmConfig,
        SamplingParams=SamplingParams,
        sha256=sha256,
        get_request_block_hasher=get_request_block_hasher,
        Scheduler=Scheduler,
        AsyncScheduler=AsyncScheduler,
        FullAttentionSpec=FullAttentionSpec,
        KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec,
        ModelRunnerOutput=ModelRunnerOutput,
        DraftTokenIds=DraftTokenIds,
        Request=Request,
        RequestStatus=RequestStatus,
        StructuredOutputManager=StructuredOutputManager,
    )


def _model_dir() -> Path:
    """A directory holding the ``config.json`` of a two-layer llama of the target's shape, written once per process."""
    directory = Path(tempfile.mkdtemp(prefix="kvfuzz-scheduler-model-"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": MODEL_SHAPE.num_query_heads * MODEL_SHAPE.head_dim,
        "intermediate_size": 16,
        "num_attention_heads": MODEL_SHAPE.num_query_heads,
        "num_key_value_heads": MODEL_SHAPE.num_kv_heads,
        "num_hidden_layers": MODEL_SHAPE.num_layers,
        "vocab_size": 64,
        "max_position_embeddings": 1 << 16,
        "torch_dtype": "float32",
        "rms_norm_eps": 1e-5,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


_MODEL_DIR: list[Path] = []  # the model directory, once written


@functools.lru_cache(maxsize=8)
def vllm_config(setup: SchedulerSetup) -> Any:
    """The ``VllmConfig`` of ``setup``: synchronous or async scheduling as it says, its policy, chunked prefill, and
    speculative decoding with ``setup.speculative_tokens`` drafts when there are any: vLLM's n-gram method, which needs
    no draft model (the scheduler sees only the number of drafts; kvfuzz's worker proposes them,
    :mod:`kvfuzz.scheduler.speculative`)."""
    v = vllm()
    if not _MODEL_DIR:
        _MODEL_DIR.append(_model_dir())
    model = v.ModelConfig(
        model=str(_MODEL_DIR[0]), skip_tokenizer_init=True, max_model_len=setup.max_model_len, dtype="float32"
    )
    cache = v.CacheConfig(block_size=setup.block_size, enable_prefix_caching=setup.prefix_caching)
    cache.num_gpu_blocks = setup.num_blocks + 1
    scheduler = v.SchedulerConfig(
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_num_seqs=setup.max_num_seqs,
        max_model_len=setup.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=setup.async_scheduling,
        policy=setup.policy,
    )
    speculative = (
        v.SpeculativeConfig(method="ngram", num_speculative_tokens=setup.speculative_tokens)
        if setup.speculative_tokens
        else None
    )
    return v.VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=scheduler,
        device_config=v.DeviceConfig(device="cpu"),
        speculative_config=speculative,
    )


def new_scheduler(setup: SchedulerSetup) -> Any:
    """A fresh ``Scheduler`` (``AsyncScheduler`` under async scheduling, as vLLM's engine core picks it) with its
    real ``KVCacheManager`` over ``num_blocks + 1`` physical blocks (block 0 is vLLM's null block)."""
    v = vllm()
    config = vllm_config(setup)
    spec = v.FullAttentionSpec(
        block_size=setup.block_size,
        num_kv_heads=MODEL_SHAPE.num_kv_heads,
        head_size=MODEL_SHAPE.head_dim,
        dtype=v.torch.float32,
    )
    layers = [f"model.layers.{index}.self_attn.attn" for index in range(MODEL_SHAPE.num_layers)]
    kv_cache = v.KVCacheConfig(
        num_blocks=setup.num_blocks + 1, kv_cache_tensors=[], kv_cache_groups=[v.KVCacheGroupSpec(layers, spec)]
    )
    scheduler = v.AsyncScheduler if setup.async_scheduling else v.Scheduler
    return scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=v.StructuredOutputManager(config),
        block_size=setup.block_size,
        log_stats=False,
    )


def new_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    block_size: int,
    arrival: int,
    priority: int = 0,
    cache_salt: Optional[str] = None,
    stop_token_ids: Optional[list[int]] = None,
) -> Any:
    """A vLLM ``Request`` generating ``max_tokens`` tokens unless one of ``stop_token_ids`` is sampled first (no
    end-of-sequence token stops it), under ``cache_salt``, its block hashes from vLLM's own hasher (sha256, the
    engine default). Its arrival time is ``arrival``, its ordinal, not the clock: the priority policy breaks ties by
    arrival time, and a replay must break them the same way."""
    v = vllm()
    return v.Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=v.SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop_token_ids),
        pooling_params=None,
        arrival_time=float(arrival),
        priority=priority,
        cache_salt=cache_salt,
        block_hasher=v.get_request_block_hasher(block_size, v.sha256),
    )
