"""Building vLLM's v1 ``Scheduler`` offline: the ``config.json`` of the configured model
(:mod:`kvfuzz.scheduler.models`) kvfuzz writes itself (no hub, no tokenizer, no GPU), a ``VllmConfig`` on the CPU
device, and a ``KVCacheConfig`` over the configured pool: for the two-layer llama one full-attention group (built
here, as the target always had it); for a hybrid model the one vLLM's own planner (``get_global_kv_cache_groups``,
``get_kv_cache_configs``) builds from the layers' specs, with ``num_gpu_blocks_override`` the pool and vLLM's hybrid
allocator on, as on a GPU (vLLM's CPU platform switches it off, and would then treat sliding-window layers as full
attention). vLLM is imported here only, on first use.

The ``VllmConfig`` is the slow part (vLLM validates the model's architecture); it is built once per configuration
and kept, and every example gets a fresh ``Scheduler`` over it (milliseconds), so that an example replays the same
way whatever ran before it."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import mmap
import tempfile
import types
from pathlib import Path
from typing import Any, Iterator, Optional

from kvfuzz.scheduler.config import MODEL_SHAPE, SchedulerSetup
from kvfuzz.scheduler.ending import Ending
from kvfuzz.scheduler.fake_model import EOS_TOKEN
from kvfuzz.scheduler.lora import lora_name
from kvfuzz.scheduler.mamba_checkpoints import checkpoint_spec
from kvfuzz.scheduler.models import FULL, MODELS, ChunkedLocalModel, MambaHybridModel, RSWAModel
from kvfuzz.scheduler.vllm_release import vllm_release


def vllm_missing() -> bool:
    """Whether vLLM cannot be found (checked without importing it)."""
    return importlib.util.find_spec("vllm") is None


@functools.lru_cache(maxsize=None)
def vllm() -> types.SimpleNamespace:
    """vLLM's modules the target drives, imported on first use (importing vLLM takes seconds)."""
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        LoRAConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        RSWASpec,
        SlidingWindowSpec,
    )
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    # The block pool logs every prefix-cache reset at INFO; the configuration warns of a token budget that a step's
    # drafts fill (the small budgets the target draws on purpose), and the scheduler's of a token budget above what its
    # running requests could use, which a swarmed configuration may draw (vLLM accepts both).
    logging.getLogger("vllm.v1.core.block_pool").setLevel(logging.WARNING)
    # ... and warns of every prefix-cache reset it refuses while blocks are in use (drawn on purpose with
    # --prefix-resets: kvfuzz checks the refusal, docs/scheduler-features.md)
    logging.getLogger("vllm.v1.core.block_pool").addFilter(
        lambda record: not str(record.msg).startswith("Failed to reset prefix cache")
    )
    logging.getLogger("vllm.config.vllm").setLevel(logging.ERROR)
    logging.getLogger("vllm.config.scheduler").setLevel(logging.ERROR)
    # The scheduler warns of every failed load it recovers from, and logs an error for every request it fails for one
    # under the "fail" policy (both drawn on purpose with --load-failures; the output check holds vLLM to them); the
    # connector's announcement is quieted where the scheduler is built (new_scheduler).
    logging.getLogger("vllm.v1.core.sched.scheduler").addFilter(
        lambda record: not str(record.msg).startswith(("Recovered from KV load failure", "Failing %d request(s)"))
    )
    # The offloading connector warns of every store its (small, drawn) offload store has no room for: an expected
    # outcome here, counted by the connector's own stats, and hundreds of lines in a campaign's standard error.
    logging.getLogger("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler").addFilter(
        lambda record: str(record.msg) != "Request %s: cannot store chunks"
    )
    init_none_hash(sha256)
    return types.SimpleNamespace(
        torch=torch,
        CacheConfig=CacheConfig,
        DeviceConfig=DeviceConfig,
        ModelConfig=ModelConfig,
        SchedulerConfig=SchedulerConfig,
        SpeculativeConfig=SpeculativeConfig,
        LoRAConfig=LoRAConfig,
        LoRARequest=LoRARequest,
        VllmConfig=VllmConfig,
        SamplingParams=SamplingParams,
        sha256=sha256,
        get_request_block_hasher=get_request_block_hasher,
        resolve_kv_cache_block_sizes=resolve_kv_cache_block_sizes,
        resolve_cache_hit_alignment_tokens=resolve_cache_hit_alignment_tokens,
        MambaSpec=MambaSpec,
        Scheduler=Scheduler,
        register_all_kvcache_specs=register_all_kvcache_specs,
        AsyncScheduler=AsyncScheduler,
        FullAttentionSpec=FullAttentionSpec,
        SlidingWindowSpec=SlidingWindowSpec,
        ChunkedLocalAttentionSpec=ChunkedLocalAttentionSpec,
        RSWASpec=RSWASpec,
        get_global_kv_cache_groups=get_global_kv_cache_groups,
        get_kv_cache_configs=get_kv_cache_configs,
        KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec,
        ModelRunnerOutput=ModelRunnerOutput,
        DraftTokenIds=DraftTokenIds,
        Request=Request,
        RequestStatus=RequestStatus,
        StructuredOutputManager=StructuredOutputManager,
    )


@functools.lru_cache(maxsize=None)
def _model_dir(model: str, block_size: int) -> Path:
    """A directory holding the ``config.json`` of ``model`` (its sliding window in ``block_size`` blocks), written
    once per process."""
    directory = Path(tempfile.mkdtemp(prefix="kvfuzz-scheduler-model-"))
    (directory / "config.json").write_text(json.dumps(MODELS[model].hf_config(MODEL_SHAPE, block_size)))
    return directory


def vllm_config(setup: SchedulerSetup) -> Any:
    """The ``VllmConfig`` of ``setup`` (built once, :func:`_built_config`), refused in one line where its drafts
    meet a model runner kvfuzz does not play them on (the runner is selected from the environment, so this is
    checked on each call; docs/scheduler-async.md#speculative-decoding-under-async-scheduling):

    * drafts under async scheduling on vLLM's V1 model runner: vLLM refuses the n-gram method there itself, and
      kvfuzz's worker plays only the V2 runner's protocol for drafts under async;
    * a parallel draft model on the V2 runner: vLLM 0.33.0 lists parallel drafting among what V2 does not support
      and runs it on V1 unless V2 is forced."""
    config = _built_config(setup)
    v2 = vllm_release().runner_v2(config)
    if setup.speculative_tokens and setup.async_scheduling and not v2:
        raise ValueError(
            "speculative decoding under async scheduling is driven with vLLM's V2 model runner only: the V1 runner "
            "refuses n-gram drafts under async, and kvfuzz's worker plays only V2's protocol for them"
        )
    if setup.drafter == "parallel" and v2:
        raise ValueError(
            "the parallel drafter is driven on vLLM's V1 model runner only: vLLM's V2 runner does not support "
            "parallel drafting (vLLM selects V1 for it unless V2 is forced)"
        )
    return config


@functools.lru_cache(maxsize=8)
def _built_config(setup: SchedulerSetup) -> Any:
    """The ``VllmConfig`` of ``setup``: synchronous or async scheduling as it says, its policy, chunked prefill, and
    speculative decoding with ``setup.speculative_tokens`` drafts when there are any: vLLM's n-gram method, which needs
    no draft model (the scheduler sees only the number of drafts; kvfuzz's worker proposes them,
    :mod:`kvfuzz.scheduler.speculative`)."""
    if setup.schedule_conservativeness != 1.0:
        raise ValueError("schedule_conservativeness is SGLang's: vLLM's scheduler takes none (only 1)")
    v = vllm()
    directory = _model_dir(setup.model, setup.block_size if setup.model != FULL.name else 1)
    model = v.ModelConfig(
        model=str(directory), skip_tokenizer_init=True, max_model_len=setup.max_model_len, dtype="float32"
    )
    cache = v.CacheConfig(block_size=setup.block_size, enable_prefix_caching=setup.prefix_caching)
    if isinstance(MODELS[setup.model], MambaHybridModel):
        # vLLM's Mamba prefix caching is its "align" mode (a state per block); without it, one state per request
        cache.mamba_cache_mode = "align" if setup.prefix_caching else "none"
    if setup.prefix_match_unit:
        # hashes finer than the block: vLLM's partial prefix-cache hits (partial_prefix.py)
        cache.prefix_match_unit = setup.prefix_match_unit
    cache.prefix_cache_retention_interval = retention_interval(setup)
    cache.num_gpu_blocks = setup.num_blocks + 1
    scheduler = v.SchedulerConfig(
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_num_seqs=setup.max_num_seqs,
        max_model_len=setup.max_model_len,
        enable_chunked_prefill=setup.chunked_prefill,
        is_encoder_decoder=False,
        async_scheduling=setup.async_scheduling,
        policy=setup.policy,
        long_prefill_token_threshold=setup.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=setup.long_prefill_token_threshold_adaptive,
        max_num_active_seqs=setup.max_num_active_seqs or None,
        prefill_schedule_interval=setup.prefill_schedule_interval,
    )
    speculative = _speculative_config(setup, model) if setup.speculative_tokens else None
    config = v.VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=scheduler,
        device_config=v.DeviceConfig(device="cpu"),
        speculative_config=speculative,
        kv_transfer_config=_kv_transfer_config(setup),
        # LoRA: the scheduler reads only max_loras (its adapter limit) and each request's adapter; the rank is the
        # smallest vLLM accepts, since no adapter is loaded
        lora_config=v.LoRAConfig(max_loras=setup.max_loras, max_lora_rank=LORA_RANK) if setup.max_loras else None,
        kv_events_config=_kv_events_config(setup),
    )
    if setup.model != FULL.name:
        # What a GPU engine core has: the hybrid allocator on (vLLM's CPU platform switches it off), the pool's size
        # as the block-count override, and a resolved KV-cache layout (the engine core resolves one; any will do,
        # only the pool's size in blocks is used).
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
        config.cache_config.num_gpu_blocks_override = setup.num_blocks + 1
        config.cache_config.kv_cache_layout = "LBNHC"
    return config


def _speculative_config(setup: SchedulerSetup, model: Any) -> Any:
    """vLLM's ``SpeculativeConfig`` for ``setup.speculative_tokens`` drafts made the way ``setup.drafter`` says: the
    n-gram method, or a draft model, parallel or not, or an EAGLE head (with lookahead block hashes, or without:
    ``eagle-drop``), whose ``config.json`` is the target's own (no weights are loaded: the scheduler reads only its
    draft slots, its lookahead and, for EAGLE, how prefix-cache hits protect the head's draft K/V). A parallel draft
    model on a vLLM that no longer takes one (0.34.0) is vLLM's own refusal, one line."""
    v = vllm()
    if setup.drafter == "ngram":
        return v.SpeculativeConfig(method="ngram", num_speculative_tokens=setup.speculative_tokens)
    from vllm.config import ParallelConfig

    methods: dict[str, dict[str, Any]] = {
        "draft-model": {"method": "draft_model"},
        "parallel": {"method": "draft_model", "parallel_drafting": True},
        "eagle": {"method": "eagle"},
        "eagle-drop": {"method": "eagle", "disable_lookahead_block_hashes": True},
    }
    method = methods[setup.drafter]
    try:
        return v.SpeculativeConfig(
            model=model.model,
            num_speculative_tokens=setup.speculative_tokens,
            target_model_config=model,
            target_parallel_config=ParallelConfig(),
            **method,
        )
    except ValueError as error:  # pydantic's ValidationError: its first error's message, in one line
        errors = getattr(error, "errors", None)
        reason = errors()[0]["msg"] if callable(errors) else str(error)
        raise ValueError(f"vLLM refuses the {setup.drafter} drafter: {reason}") from None


def hash_lookahead(setup: SchedulerSetup) -> int:
    """The tokens after each block its prefix-cache hash covers under ``setup`` (vLLM's
    ``num_hash_lookahead_tokens``: an EAGLE head's, unless turned off), as vLLM's engine core gives its request block
    hasher; 0: the hash covers the block alone."""
    return int(getattr(vllm_config(setup), "num_hash_lookahead_tokens", 0))


def retention_interval(setup: SchedulerSetup) -> Optional[int]:
    """vLLM's ``prefix_cache_retention_interval`` for ``setup.retention``: 0 (semantic checkpoints only, vLLM's
    default), None (every block) or four blocks (periodic: more than a sliding window of two blocks needs for a hit)."""
    return {"semantic": 0, "dense": None, "periodic": 4 * setup.block_size}[setup.retention]


LORA_RANK = 8
"""The ``max_lora_rank`` of the target's ``LoRAConfig``: small (no adapter's weights exist; the scheduler never reads
it)."""


def _kv_events_config(setup: SchedulerSetup) -> Any:
    """KV cache events on, published by the null publisher (kvfuzz installs its own in each scheduler:
    :mod:`kvfuzz.scheduler.kv_events`); or None."""
    if not setup.kv_events:
        return None
    from vllm.config import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="null")


def _kv_transfer_config(setup: SchedulerSetup) -> Any:
    """vLLM's ``OffloadingConnector`` (both roles, as an engine that offloads and reloads its own blocks) over an
    offload store of as many chunks as the pool has blocks, one block per chunk, failed loads recomputed; kvfuzz's
    P/D connector (both roles: a consumer of a remote producer's prefills, a producer for a remote decoder), loaded
    by vLLM's connector factory from its module, under the setup's load failure policy; or None."""
    if setup.kv_connector == "none":
        return None
    from vllm.config import KVTransferConfig

    if setup.kv_connector == "pd":
        return KVTransferConfig(
            kv_connector="KvfuzzPDConnector",
            kv_connector_module_path="kvfuzz.scheduler.pd_connector",
            kv_role="kv_both",
            kv_load_failure_policy=setup.load_failure_policy,
        )

    kv_bytes_per_block = (
        2 * MODEL_SHAPE.num_layers * MODEL_SHAPE.num_kv_heads * MODEL_SHAPE.head_dim * 4 * setup.block_size
    )
    page = mmap.PAGESIZE  # vLLM's CPU store aligns each chunk to a memory page
    chunk_bytes = -(-kv_bytes_per_block // page) * page
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"cpu_bytes_to_use": setup.num_blocks * chunk_bytes},
    )


def _layer_specs(setup: SchedulerSetup) -> dict[str, Any]:
    """The KV-cache spec of each layer of the model, as vLLM's layers report them to the model runner: full
    attention, a sliding window of the model's window, or R-SWA, of the target's K/V shape; for a Mamba hybrid, its
    Mamba layers' ``MambaSpec`` first (:func:`_mamba_specs`); with an EAGLE drafter, the head's layer
    (:data:`DRAFT_LAYER`) last, a full-attention spec marked ``is_draft``, as a drafter's layers report theirs."""
    v = vllm()
    model = MODELS[setup.model]
    shape = {
        "block_size": setup.block_size,
        "num_kv_heads": MODEL_SHAPE.num_kv_heads,
        "head_size": MODEL_SHAPE.head_dim,
        "dtype": v.torch.float32,
    }
    window = model.sliding_window(setup.block_size)
    first = model.mamba_layers if isinstance(model, MambaHybridModel) else 0
    specs = {}
    if isinstance(model, ChunkedLocalModel):
        chunk = model.attention_chunk(setup.block_size)
        for index in range(model.local_layers):
            specs[f"model.layers.{index}.self_attn.attn"] = v.ChunkedLocalAttentionSpec(
                **shape, attention_chunk_size=chunk
            )
        first = model.local_layers
    for index, blocks in enumerate(model.window_blocks, start=first):
        if isinstance(model, RSWAModel):  # what vLLM's RSWAAttention reports: a full-attention spec with its window
            spec = v.RSWASpec(**shape, rswa_window=model.rswa_window(setup.block_size))
        elif blocks is None:
            spec = v.FullAttentionSpec(**shape)
        else:
            spec = v.SlidingWindowSpec(**shape, sliding_window=window)
        specs[f"model.layers.{index}.self_attn.attn"] = spec
    if setup.drafter.startswith("eagle"):  # the head's one full-attention layer, marked as a drafter's
        specs[DRAFT_LAYER] = v.FullAttentionSpec(**shape, is_draft=True)
    if isinstance(model, MambaHybridModel):
        page = max(spec.page_size_bytes for spec in specs.values())
        return _mamba_specs(setup, model, page) | specs
    return specs


DRAFT_LAYER = "draft_model.model.layers.0.self_attn.attn"
"""The name of an EAGLE head's attention layer in the KV cache config (the head has one, full attention; vLLM groups it
with the target's full-attention layers and marks that group as the one taking the EAGLE block drop)."""


def _mamba_specs(setup: SchedulerSetup, model: MambaHybridModel, page: int) -> dict[str, Any]:
    """The ``MambaSpec`` of each Mamba layer, as vLLM's Mamba layer reports it: the state shapes and dtypes of the
    model class (``JambaForCausalLM``), a block of ``cache_config.mamba_block_size`` tokens (the model length:
    ``mamba_cache_mode="none"`` keeps one state per request), its page padded to the attention page ``page``, as
    vLLM's hybrid configuration pads it; with ``setup.mamba_checkpoints``, the prefill checkpoints of a Mamba2 layer
    (:mod:`kvfuzz.scheduler.mamba_checkpoints`)."""
    from vllm.model_executor.models.jamba import JambaForCausalLM  # the Mamba model's state shapes, on first use

    v = vllm()
    config = vllm_config(setup)
    spec = v.MambaSpec(
        block_size=config.cache_config.mamba_block_size,
        shapes=JambaForCausalLM.get_mamba_state_shape_from_config(config),
        dtypes=JambaForCausalLM.get_mamba_state_dtype_from_config(config),
        page_size_padded=page,
        mamba_cache_mode=config.cache_config.mamba_cache_mode,
    )
    if spec.page_size_bytes != page:
        raise ValueError(f"a Mamba state of {spec.page_size_bytes} bytes does not fit the attention page of {page}")
    spec = checkpoint_spec(spec, setup)  # a Mamba2 layer's prefill checkpoints, where the setup asks for them
    return {f"model.layers.{index}.mamba": spec for index in range(model.mamba_layers)}


@functools.lru_cache(maxsize=8)
def kv_cache_config(setup: SchedulerSetup) -> Any:
    """The ``KVCacheConfig`` of ``setup``: ``num_blocks + 1`` blocks (block 0 is vLLM's null block) in one pool that
    every group allocates from. Raises ``ValueError`` (vLLM's) where the pool cannot hold the model's longest
    request, or vLLM plans another pool size."""
    v = vllm()
    if setup.model == FULL.name:
        specs = _layer_specs(setup)
        (spec,) = {spec for name, spec in specs.items() if name != DRAFT_LAYER}
        # an EAGLE head's layer shares the target's spec, so its group: the group that takes the EAGLE block drop
        group = v.KVCacheGroupSpec(list(specs), spec, is_eagle_group=DRAFT_LAYER in specs)
        return v.KVCacheConfig(num_blocks=setup.num_blocks + 1, kv_cache_tensors=[], kv_cache_groups=[group])
    config = vllm_config(setup)
    specs = _layer_specs(setup)
    groups = v.get_global_kv_cache_groups(config, [specs])
    (planned,) = v.get_kv_cache_configs(config, [specs], [1 << 40], groups)
    if planned.num_blocks != setup.num_blocks + 1:
        raise ValueError(f"vLLM planned {planned.num_blocks} blocks for a pool of {setup.num_blocks + 1}")
    return planned


def _block_sizes(kv_config: Any, config: Any) -> tuple[int, int]:
    """The engine core's block sizes for a setup's KV cache and vLLM configurations: the scheduler's block (the
    pool's for attention groups alone; with a Mamba group the LCM of every group's block size, its Mamba block
    spanning the model length) and the hash block."""
    block_size, hash_block_size = vllm().resolve_kv_cache_block_sizes(kv_config, config)
    return int(block_size), int(hash_block_size)


def cache_hit_alignment_tokens(setup: SchedulerSetup) -> int:
    """Where ``setup``'s prefix-cache hits land, as vLLM's engine core resolves it for its workers (the hash block
    with partial prefix-cache hits, the scheduler's block otherwise)."""
    kv_config, config = kv_cache_config(setup), vllm_config(setup)
    return int(vllm().resolve_cache_hit_alignment_tokens(kv_config, config, *_block_sizes(kv_config, config)))


def new_scheduler(setup: SchedulerSetup) -> Any:
    """A fresh ``Scheduler`` (``AsyncScheduler`` under async scheduling, as vLLM's engine core picks it) with its
    real ``KVCacheManager`` over ``num_blocks + 1`` physical blocks (block 0 is vLLM's null block)."""
    v = vllm()
    config = vllm_config(setup)
    scheduler = v.AsyncScheduler if setup.async_scheduling else v.Scheduler
    # vLLM's engine core registers the built-in KV cache specs and their managers each time it prepares a KV cache
    # (idempotent), before it plans one; so does each example's engine here
    v.register_all_kvcache_specs(config)
    kv_config = kv_cache_config(setup)
    block_size, hash_block_size = _block_sizes(kv_config, config)
    with quieted(CONNECTOR_LOGGER):
        return scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            structured_output_manager=v.StructuredOutputManager(config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            log_stats=setup.stats,
        )


CONNECTOR_LOGGER = "vllm.distributed.kv_transfer.kv_connector.v1.base"
"""The logger of vLLM's KV connector base class, which warns that its API is experimental each time a connector is
built: once per example under a connector, so a campaign printed it hundreds of times."""


@contextlib.contextmanager
def quieted(name: str) -> Iterator[None]:
    """The logger ``name`` passes only errors while the block runs: a filter, added and removed (setting its level
    would clear the cache of every logger twice per example, vLLM's hundreds among them)."""
    logger = logging.getLogger(name)
    logger.addFilter(_errors_only)
    try:
        yield
    finally:
        logger.removeFilter(_errors_only)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def new_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    block_size: int,
    arrival: int,
    priority: int = 0,
    cache_salt: Optional[str] = None,
    ending: Ending = Ending(),
    lora: int = 0,
    resumable: bool = False,
    full_reports: bool = False,
    skip_reads: bool = False,
    hash_lookahead: int = 0,
) -> Any:
    """A vLLM ``Request`` generating ``max_tokens`` tokens unless ``ending`` stops it first (its stop token ids, the
    model's EOS token :data:`~kvfuzz.scheduler.fake_model.EOS_TOKEN` unless it ignores EOS, its ``min_tokens``: EOS
    is given as vLLM's input processor gives the tokenizer's, through ``update_from_generation_config``, which also
    adds it to the ``all_stop_token_ids`` the sampler masks before ``min_tokens``), under ``cache_salt``, its block
    hashes from vLLM's own hasher (sha256, the engine default). Its arrival time is ``arrival``, its ordinal, not
    the clock: the priority policy breaks ties by arrival time, and a replay must break them the same way. Under
    LoRA adapter ``lora`` (0: none) it carries a ``LoRARequest`` of that id, named (and its path) as
    :func:`~kvfuzz.scheduler.lora.lora_name` names it: no adapter exists, the scheduler reads only those.
    ``resumable``: a streaming session's request (:mod:`kvfuzz.scheduler.sessions`); left at vLLM's default when
    false. ``full_reports``: its KV cache events are reported in full (``kv_cache_report_mode`` "full", a sampling
    parameter's extra argument, as a client asks for it), else incrementally (vLLM's default). ``skip_reads``: it skips
    reading the prefix cache (``skip_reading_prefix_cache``), else vLLM's default (it reads, asking no prompt
    logprobs). ``hash_lookahead``: the tokens after each block its block hashes cover (:func:`hash_lookahead`)."""
    v = vllm()
    sampling = v.SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=not ending.eos,
        stop_token_ids=list(ending.stop_token_ids),
        min_tokens=ending.min_tokens,
        extra_args={"kv_cache_report_mode": "full"} if full_reports else None,
        skip_reading_prefix_cache=True if skip_reads else None,
    )
    sampling.update_from_generation_config({}, EOS_TOKEN)
    return v.Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=sampling,
        pooling_params=None,
        arrival_time=float(arrival),
        priority=priority,
        cache_salt=cache_salt,
        lora_request=v.LoRARequest(lora_name(lora), lora, lora_name(lora)) if lora else None,
        block_hasher=v.get_request_block_hasher(block_size, v.sha256, hash_lookahead),
        **({"resumable": True} if resumable else {}),
    )
