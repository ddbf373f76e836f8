"""Importing SGLang's memory-cache modules on a CPU-only machine, and the runtime context they read.

Two of SGLang's model-config modules, imported at module level by ``sglang.srt.mem_cache.memory_pool``, import
``torchvision.transforms`` for constants (``InterpolationMode``) used only by multimodal preprocessing. The
torchvision wheel does not load beside the CPU build of torch, so when ``import torchvision`` fails we register a
stand-in holding only ``InterpolationMode``: the KV-cache code never touches torchvision, and any real use of the
stand-in fails loudly with an AttributeError. transformers is imported first so that its cached
``is_torchvision_available()`` answers False and it never reaches for the stand-in.

SGLang's scheduler code reads process-wide configuration (speculative decoding, serving options) through
``sglang.srt.runtime_context``. We build one context from default ``ServerArgs`` (CPU device, no speculative
decoding, no disaggregation) and activate it around each call with ``use_context``, so nothing process-wide is
published.
"""

from __future__ import annotations

import enum
import functools
import importlib
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

if importlib.util.find_spec("sglang") is None:
    # Fail at import, so that a trace naming this adapter is skipped where SGLang is not installed.
    raise ImportError(
        "kvfuzz.adapters.sglang needs sglang 0.5.23; build an environment with scripts/third_party_env.sh sglang"
    )


class _InterpolationMode(enum.Enum):
    """The names SGLang's multimodal configs read from ``torchvision.transforms.InterpolationMode``."""

    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


def _install_torchvision_stand_in() -> None:
    """Register ``torchvision``, ``.transforms`` and ``.transforms.functional`` holding only InterpolationMode."""
    try:
        importlib.import_module("torchvision")
        return
    except Exception:  # noqa: BLE001 -- a wheel that fails to load (not only a missing one) gets the stand-in
        pass
    # transformers caches is_torchvision_available() == False at import, before the stand-in exists.
    importlib.import_module("transformers")

    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    modules = [types.ModuleType(name) for name in names]
    # ModuleType declares none of these attributes, so they go straight into each module's namespace.
    for module in modules:
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
        vars(module)["InterpolationMode"] = _InterpolationMode
    root, transforms, functional = modules
    vars(root)["transforms"], vars(transforms)["functional"] = transforms, functional
    sys.modules.update(zip(names, modules))


@functools.lru_cache(maxsize=None)
def sglang() -> types.SimpleNamespace:
    """SGLang's classes and scheduler functions the adapter drives, imported once."""
    _install_torchvision_stand_in()
    from sglang.srt.environ import envs
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
    from sglang.srt.mem_cache.allocation import (
        alloc_paged_token_slots_decode,
        alloc_paged_token_slots_extend,
        alloc_req_slots,
    )
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, evict_from_tree_cache, release_kv_cache
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    context = create_context(ServerArgs(model_path="dummy", device="cpu"), role="scheduler")
    return types.SimpleNamespace(
        Req=Req,
        FINISH_ABORT=FINISH_ABORT,
        FINISH_LENGTH=FINISH_LENGTH,
        SamplingParams=SamplingParams,
        PagedTokenToKVPoolAllocator=PagedTokenToKVPoolAllocator,
        ReqToTokenPool=ReqToTokenPool,
        RadixCache=RadixCache,
        EvictParams=EvictParams,
        CacheInitParams=CacheInitParams,
        alloc_req_slots=alloc_req_slots,
        alloc_paged_token_slots_extend=alloc_paged_token_slots_extend,
        alloc_paged_token_slots_decode=alloc_paged_token_slots_decode,
        checkpoint_kv_cache=checkpoint_kv_cache,
        release_kv_cache=release_kv_cache,
        evict_from_tree_cache=evict_from_tree_cache,
        retract_decode_steps=envs.SGLANG_RETRACT_DECODE_STEPS.get,
        context=context,
        use_context=use_context,
        create_context=create_context,
        ServerArgs=ServerArgs,
    )


def in_context(method: Any) -> Any:
    """Run an adapter method with SGLang's runtime context active: the adapter's own ``runtime_context`` when it
    has one (the host-tier adapter serves with other options), else the default one."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        engine = sglang()
        with engine.use_context(getattr(self, "runtime_context", None) or engine.context):
            return method(self, *args, **kwargs)

    return wrapper
