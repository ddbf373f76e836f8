"""What vLLM v1's ``Scheduler`` keeps beside its ``KVCacheManager``, as :mod:`kvfuzz.adapters.vllm_v1` emulates it:
how the manager is configured and driven (:class:`VllmOptions`), the requests' extra hash keys that carry a
namespace, the deferred frees of a scheduler with batches in flight, and the tokens a launched step computes.

vLLM itself is imported on first use (:func:`import_vllm`), so this module imports without it; the adapter module
refuses to import where vLLM is not installed.
"""

from __future__ import annotations

import functools
import json
import logging
import types
from collections import Counter, deque
from typing import Any, Callable, Optional

import attrs

from kvfuzz.allocator.types import Namespace

MAX_MODEL_LEN = 1 << 20
"""The manager's ``max_model_len``: far above any sequence kvfuzz builds, so vLLM never caps a sequence's slots."""


@functools.cache
def import_vllm() -> types.SimpleNamespace:
    """vLLM's modules, imported on first use (importing vLLM takes seconds); the namespace is built once and shared
    by every allocator (each example builds one: rebuilding it cost about a millisecond), so nobody may change it."""
    import torch
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.request import Request, RequestStatus

    # reset_prefix_cache logs every success at INFO; kvfuzz resets the cache at the end of every example.
    logging.getLogger("vllm.v1.core.block_pool").setLevel(logging.WARNING)
    return types.SimpleNamespace(
        torch=torch,
        LoRARequest=LoRARequest,
        SamplingParams=SamplingParams,
        sha256=sha256,
        KVCacheManager=KVCacheManager,
        get_request_block_hasher=get_request_block_hasher,
        init_none_hash=init_none_hash,
        FullAttentionSpec=FullAttentionSpec,
        KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec,
        SlidingWindowSpec=SlidingWindowSpec,
        Request=Request,
        RequestStatus=RequestStatus,
    )


@attrs.frozen
class VllmOptions:
    """How the manager is configured and driven.

    ``namespace_key`` is ``"cache_salt"`` or ``"lora"``: which of vLLM's extra hash keys carries a namespace.
    ``inflight_window`` W > 0 emulates the scheduler's deferred frees with W + 1 batches in flight.
    ``sliding_window`` (tokens) builds a sliding-window group instead of full attention.
    ``priority_policy`` says the scheduler may preempt a request it has already scheduled in this round (vLLM's
    priority policy); under FCFS it takes its victims before scheduling them.
    ``speculative_tokens`` is vLLM's ``num_speculative_tokens`` (0: no speculative decoding), and
    ``lookahead_tokens`` its ``num_lookahead_tokens``: k for an EAGLE or draft-model proposer, 0 for n-gram.
    ``kv_connector`` says a KV connector (or offloading) evicts particular blocks by id (``evict_blocks``), which
    the adapter then declares as targeted eviction; without one, vLLM never calls it.
    """

    prefix_caching: bool = True
    namespace_key: str = attrs.field(default="cache_salt", validator=attrs.validators.in_(("cache_salt", "lora")))
    inflight_window: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    sliding_window: Optional[int] = None
    priority_policy: bool = False
    speculative_tokens: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    lookahead_tokens: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    kv_connector: bool = False


class NamespaceKeys:
    """Maps kvfuzz namespaces onto a request's extra hash keys, injectively: equal keys only for equal namespaces.

    Each non-empty namespace gets one LoRA adapter id, kept for the life of the allocator.
    """

    def __init__(self, kind: str, lora_request: Callable[..., Any]) -> None:
        self._kind = kind
        self._lora_request = lora_request
        self._lora_ids: dict[Namespace, int] = {}

    def request_kwargs(self, namespace: Namespace) -> dict[str, Any]:
        if not namespace:
            return {}
        encoded = json.dumps(list(namespace))
        if self._kind == "cache_salt":
            return {"cache_salt": encoded}
        lora_id = self._lora_ids.setdefault(namespace, len(self._lora_ids) + 1)
        return {
            "lora_request": self._lora_request(
                lora_name=encoded, lora_int_id=lora_id, lora_path=f"/kvfuzz/lora/{lora_id}"
            )
        }


class DeferredFrees:
    """Released blocks held back until a step completes, as ``Scheduler.deferred_frees`` holds them.

    Each queued entry keeps one ``ref_cnt`` on every block it lists; ``holds[block_id]`` counts the entries listing a
    block. Entries are returned, tail blocks first, once their fence step has completed (a subclass may queue a later
    fence before an earlier one).
    """

    def __init__(self) -> None:
        self._queue: deque[tuple[int, list[Any]]] = deque()
        self.holds: Counter[int] = Counter()

    def defer(self, fence: int, blocks: list[Any]) -> list[Any]:
        """Queue ``blocks`` (less the null block) until step ``fence`` has completed; returns the list queued."""
        blocks = [block for block in blocks if not block.is_null]
        if blocks:
            self._queue.append((fence, blocks))
            self.holds.update(block.block_id for block in blocks)
        return blocks

    def refence(self, blocks: list[Any], fence: int) -> None:
        """The entry queued with exactly the list ``blocks`` now waits for step ``fence`` instead."""
        self._queue = deque((fence if listed is blocks else old, listed) for old, listed in self._queue)

    def drain(self, completed: int, free_blocks: Callable[[Any], None]) -> None:
        """Return every entry whose fence step has completed, in queue order."""
        kept: deque[tuple[int, list[Any]]] = deque()
        for fence, blocks in self._queue:
            if fence > completed:
                kept.append((fence, blocks))
                continue
            self.holds.subtract(block.block_id for block in blocks)
            free_blocks(reversed(blocks))
        self._queue = kept


UNTIL_LOADS_LAND = 1 << 62
"""The fence of a deferred free that waits for a request's asynchronous loads rather than a step (re-fenced once the
loads are reported landed)."""


@attrs.frozen
class InFlight:
    """``tokens`` tokens of ``request`` are computed by a step that has completed once step ``done_after`` has."""

    done_after: int
    request: Any
    tokens: int
