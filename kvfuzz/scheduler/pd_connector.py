"""The scheduler side of kvfuzz's P/D-disaggregation connector, a KV connector vLLM builds from its
``KVTransferConfig`` (``kv_connector_module_path`` names this module): it plays the remote engines of a
prefill/decode deployment, as a consumer and a producer (``kv_both``).

* **Consumer**: a new request's prompt was prefilled by a remote producer, so part of it (drawn per request) is an
  external prefix hit beyond the local prefix cache's, loaded asynchronously (the request waits in
  ``WAITING_FOR_REMOTE_KVS``; the whole prompt may be hit) or, one request in three, synchronously in the step that
  schedules it (the prompt's last token left to compute). A request is offered its remote prefix until a load
  of it is ordered; never again after (a resumed request recomputes). A one-token prompt is offered none: a
  whole-prompt hit on it is the known reload loop of docs/scheduler-connectors.md.
* **Producer**: a request that finished by its own tokens (not aborted) is sent to a remote decoder one time in two:
  ``request_finished_all_groups`` returns ``delay_free_blocks=True``, and vLLM keeps its blocks (every group's)
  until kvfuzz's worker side reports the send in ``finished_sending``.
* **Hybrid models**: the connector supports vLLM's hybrid allocator (``SupportsHMA``) and, as NIXL's does, divergent
  local hybrid hits: on a Mamba hybrid vLLM offers the full-attention group's local hit even where the Mamba group's
  ended earlier, and a load completes it, its Mamba state included (the state after the load's last token, which
  kvfuzz's worker side writes into the request's state block). There, as NIXL's, a remote prefix stops at the
  prompt's last token but one (the state after the whole prompt cannot be stepped back to recompute its last
  token), and every load is async: a sync load on a Mamba hybrid with prefix caching crashes vLLM 0.33.0's scheduler
  (docs/findings.md: the decode-bench connector on the hybrid), so the connector does not offer one there.

Every decision is a deterministic draw from the request (:func:`draw`), so a replay makes the same. The scheduler
tells the worker side (:mod:`kvfuzz.scheduler.disaggregation`) what to load and send through
:class:`PDMetadata`, the step's connector metadata, as a real connector does; the worker side performs the
transfers, times their completion, and checks them.

This module subclasses vLLM's connector base class, so it imports vLLM: only vLLM imports it (through the factory),
never kvfuzz's own layers."""

from __future__ import annotations

import zlib
from typing import Any, Optional

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, SupportsHMA

CONNECTOR_NAME = "KvfuzzPDConnector"
"""The class name vLLM's connector factory loads from this module."""


def draw(*parts: object) -> int:
    """A deterministic draw from ``parts`` (the same in every run and replay)."""
    return zlib.crc32(repr(parts).encode())


@attrs.frozen
class Load:
    """A remote prefix the scheduler ordered loaded: the request, its tables (one per KV-cache group, when the load
    was ordered), the positions the load fills, the tokens up to them (the remote prefill's), whether it is async,
    and the blocks vLLM handed the connector as not yet cached."""

    request: str
    tables: tuple[tuple[int, ...], ...]  # per KV-cache group, in vLLM's group order
    start: int  # the first position the load fills (the local prefix hit's end)
    stop: int  # one past the last
    tokens: tuple[int, ...]  # the prompt's tokens up to ``stop``
    asynchronous: bool  # loaded between steps (the request waits for it), or in the step that schedules it
    # an async load's, per group: the blocks vLLM reports without a block hash
    # (``get_unhashed_block_ids_all_groups``), which a P2P connector (NIXL's) writes the load into; empty for a sync
    # load (its blocks are cached as it is ordered)
    unhashed: tuple[tuple[int, ...], ...] = ()


@attrs.frozen
class Send:
    """A finished request's blocks sent to a remote decoder (every group's, vLLM's null block left out): vLLM keeps
    them until the send is reported."""

    request: str
    blocks: tuple[int, ...]


class PDMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """The step's connector metadata: the loads and sends the scheduler ordered since the last step."""

    def __init__(self, loads: tuple[Load, ...], sends: tuple[Send, ...]) -> None:
        self.loads = loads
        self.sends = sends


class KvfuzzPDConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """The scheduler side (vLLM builds one per scheduler). Invariants: ``offered`` holds the remote prefix each
    request was last offered (its local hit's end, the tokens offered) until a load of it is ordered; a request in
    ``loaded`` is offered nothing; ``loads`` and ``sends`` are ordered and not yet in a step's metadata."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # a Mamba hybrid's loads carry the state at their end: async only, and short of the prompt's last token
        self.mamba = kv_cache_config is not None and bool(kv_cache_config.has_mamba_layers)
        self.offered: dict[str, tuple[int, int, bool]] = {}  # request -> (local hit's end, tokens offered, async)
        self.loaded: set[str] = set()  # requests whose remote prefix a load was ordered of
        self.loads: list[Load] = []
        self.sends: list[Send] = []

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """A load completes a hybrid hit whose Mamba group ended before its full-attention group (as NIXL's)."""
        return True

    # -- the scheduler's calls -------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """The remote prefix beyond the local hit, drawn per request: none one time in four, else async two times in
        three (one token up to the rest of the prompt) or sync (up to the prompt's last token but one); on a Mamba
        hybrid always async, up to the prompt's last token but one."""
        request_id = request.request_id
        prompt = tuple(request.prompt_token_ids or ())
        rest = len(prompt) - num_computed_tokens
        if request_id in self.loaded or len(prompt) < 2 or rest < 1 or draw("remote", request_id, prompt) % 4 == 0:
            return 0, False
        asynchronous = self.mamba or draw("async", request_id, prompt) % 3 != 0
        # a sync load leaves the step a token to compute, as vLLM asserts; a Mamba state ends one short of the prompt
        most = rest if asynchronous and not self.mamba else rest - 1
        if most < 1:
            return 0, False
        count = 1 + draw("count", request_id, prompt) % most
        self.offered[request_id] = (num_computed_tokens, count, asynchronous)
        return count, asynchronous

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """A load of the offered remote prefix, into the request's blocks, is ordered (for the next metadata)."""
        request_id = request.request_id
        if num_external_tokens == 0 or request_id not in self.offered:
            return
        start, count, asynchronous = self.offered.pop(request_id)
        if count != num_external_tokens:
            raise ValueError(f"{request_id}: {num_external_tokens} external tokens allocated, {count} offered")
        stop = start + count
        tables = tuple(tuple(table) for table in blocks.get_block_ids())
        unhashed = tuple(map(tuple, blocks.get_unhashed_block_ids_all_groups())) if asynchronous else ()
        self.loaded.add(request_id)
        prompt = tuple(request.prompt_token_ids)
        self.loads.append(Load(request_id, tables, start, stop, prompt[:stop], asynchronous, unhashed))

    def build_connector_meta(self, scheduler_output: Any) -> PDMetadata:
        meta = PDMetadata(tuple(self.loads), tuple(self.sends))
        self.loads = []
        self.sends = []
        return meta

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        """A request that finished by its own tokens is sent one time in two: its blocks' free (every group's) is
        delayed until the send is reported."""
        self.offered.pop(request.request_id, None)
        finished_by_itself = request.status.name in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
        blocks = tuple(sorted({block for group in block_ids for block in group} - {0}))
        if not finished_by_itself or not blocks or draw("send", request.request_id) % 2:
            return False, None
        self.sends.append(Send(request.request_id, blocks))
        return True, None

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """One group's finish: the same as every group's (vLLM calls this only of a connector without
        ``SupportsHMA``; the base class declares it)."""
        return self.request_finished_all_groups(request, (block_ids,))

    # -- the worker side's methods: kvfuzz's worker (kvfuzz.scheduler.disaggregation) plays them ------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError("kvfuzz's worker side performs the loads")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError("kvfuzz's worker side performs the loads")

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        raise NotImplementedError("kvfuzz's worker side performs the sends")

    def wait_for_save(self) -> None:
        raise NotImplementedError("kvfuzz's worker side performs the sends")
