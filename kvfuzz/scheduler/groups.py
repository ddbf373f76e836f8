"""What the worker holds vLLM to in each KV-cache group of the model: which positions of a request its table must
still serve, and where vLLM's null block is legal.

* **full attention**: every position a request has computed is attended again by each later token, so every table
  entry up to the request's computed tokens must be a real block holding its K/V; the null block never appears.
* **sliding window** of ``W`` tokens: a token at position ``p`` attends ``p - W + 1 .. p`` only, so once a request
  has computed ``c`` tokens, positions before ``c - W + 1`` are never read again. vLLM's sliding-window manager frees
  the blocks wholly before that point (``remove_skipped_blocks``, when it next allocates for the request) and a
  prefix-cache hit hands such blocks over as the null block: a table entry wholly before the first needed position
  may be the null block, a stale block id (the model runner nulls those itself) or a block still held; every entry
  from the first needed position on must be a real block holding the right K/V.
* **reference sliding window** (R-SWA) of ``W`` tokens: the prompt stays visible to every token, and a generated
  token attends the prompt and ``p - W + 1 .. p``; vLLM's R-SWA manager frees the blocks wholly inside the gap
  between the prompt's last block and the window (``RSWAManager.remove_skipped_blocks``, when it next allocates for
  the request): every entry up to the prompt's last one, and every one from the window's first on, must be a real
  block holding the right K/V; an entry in the gap may be the null block, a stale id or a block still held.
* **chunked local attention** of ``C`` tokens (Llama 4's local layers): a token at position ``p`` attends the
  positions of its own chunk only, ``p // C * C .. p``, so once a request has computed ``c`` tokens, positions before
  ``c // C * C`` are never read again; vLLM's chunked-local manager frees the blocks wholly before that point and a
  prefix-cache hit hands them over as the null block, as for a sliding window.

Each group's K/V is the content of its own layers, so the worker tags a group's K/V with the group
(:func:`group_namespace`): a block two groups use at once (they alias the same memory in vLLM's hybrid allocator)
is a write over another group's content."""

from __future__ import annotations

from typing import Any, Optional

import attrs

from kvfuzz.scheduler.kv_slots import GROUP_PREFIX


@attrs.frozen
class GroupRule:
    """One KV-cache group: its index in the ``KVCacheConfig``, its sliding window or its attention chunk (both None:
    full attention; at most one is set)."""

    index: int
    window: Optional[int]  # tokens a position attends back, itself included; None: no sliding window
    chunk: Optional[int] = None  # chunked local attention: a position attends its own chunk of this many tokens
    keeps_prompt: bool = False  # R-SWA: the prompt stays attended besides the window (``window`` is R-SWA's)

    @property
    def reads_all(self) -> bool:
        """Whether every position stays attended (full attention)."""
        return self.window is None and self.chunk is None

    def first_needed(self, computed: int) -> int:
        """The first position after the kept prompt (:meth:`kept_prefix`) a request with ``computed`` tokens
        computed still reads (when it computes its next): the first the token at position ``computed`` attends to."""
        if self.chunk is not None:
            return computed // self.chunk * self.chunk
        return 0 if self.window is None else max(0, computed - self.window + 1)

    def kept_prefix(self, prompt: int) -> int:
        """The positions at the start every token attends whatever :meth:`first_needed` says: a prompt of
        ``prompt`` tokens under R-SWA; none otherwise."""
        return prompt if self.keeps_prompt else 0

    def attended(self, start: int, end: int, prompt: int) -> tuple[range, ...]:
        """The positions below ``end`` that the tokens at ``start .. end - 1`` of a request with a prompt of
        ``prompt`` tokens attend (with ``end == start``: those a request that computed ``start`` still reads), in at
        most two runs: the kept prompt, then from :meth:`first_needed` of ``start`` on."""
        first, kept = self.first_needed(start), min(self.kept_prefix(prompt), end)
        if kept >= first:
            return (range(0, end),)
        return tuple(run for run in (range(0, kept), range(first, end)) if run)

    def released_entries(self, computed: int, prompt: int, block_size: int) -> range:
        """The table entries vLLM may have released (wholly outside what :meth:`attended` reads): those before
        :meth:`first_kept_entry` and after the kept prompt's last (none where the two meet); every other entry must
        hold a real block."""
        first = -(-self.kept_prefix(prompt) // block_size)
        return range(first, max(first, self.first_kept_entry(computed, block_size)))

    def first_kept_entry(self, computed: int, block_size: int) -> int:
        """The first table entry that must hold a real block: entries before it are wholly before
        :meth:`first_needed`."""
        return self.first_needed(computed) // block_size

    def describe(self) -> str:
        kind = (
            f"chunked local attention of {self.chunk} tokens"
            if self.chunk is not None
            else f"reference sliding window of {self.window} tokens, the prompt kept"
            if self.keeps_prompt
            else "full attention"
            if self.window is None
            else f"sliding window of {self.window} tokens"
        )
        return f"group {self.index} ({kind})"


def group_namespace(index: int) -> tuple[str, ...]:
    """The namespace a group's K/V is tagged under: none for group 0 (so a one-group model's K/V is what it always
    was), the group's name for the others; a request's cache salt, if any, follows it."""
    return () if index == 0 else (f"{GROUP_PREFIX}{index}",)


def group_rules(kv_cache_config: Any) -> tuple[GroupRule, ...]:
    """The rule of each attention group of vLLM's ``KVCacheConfig``, in its order (a sliding-window spec is a
    sliding-window group, a chunked-local-attention spec a chunked one; a full-attention spec is full attention).
    Mamba groups have no K/V positions: :func:`mamba_groups` names them, :mod:`kvfuzz.scheduler.mamba_states` models
    them."""
    rules = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        kind = type(group.kv_cache_spec).__name__
        if kind == "MambaSpec":
            continue
        if kind not in ("FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec", "RSWASpec"):
            raise ValueError(f"KV-cache group {index} is a {kind}, which the worker does not model")
        if kind == "RSWASpec":
            rules.append(GroupRule(index, group.kv_cache_spec.rswa_window, keeps_prompt=True))
            continue
        window = group.kv_cache_spec.sliding_window if kind == "SlidingWindowSpec" else None
        chunk = group.kv_cache_spec.attention_chunk_size if kind == "ChunkedLocalAttentionSpec" else None
        rules.append(GroupRule(index, window, chunk))
    return tuple(rules)


def mamba_groups(kv_cache_config: Any) -> tuple[tuple[int, ...], str, int]:
    """The indices of the Mamba groups of vLLM's ``KVCacheConfig``, their ``mamba_cache_mode`` and block size (one
    for all: vLLM's planner gives the Mamba layers one spec); ``((), "none", 1)`` without Mamba groups."""
    specs = {
        index: group.kv_cache_spec
        for index, group in enumerate(kv_cache_config.kv_cache_groups)
        if type(group.kv_cache_spec).__name__ == "MambaSpec"
    }
    if not specs:
        return (), "none", 1
    (mode,) = {spec.mamba_cache_mode for spec in specs.values()}
    (block_size,) = {spec.block_size for spec in specs.values()}
    return tuple(specs), mode, block_size
