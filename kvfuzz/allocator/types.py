"""Value types of the allocator contract: capabilities and what each operation returns.

All are frozen attrs classes: results are facts about one call, never updated afterwards.
"""

from __future__ import annotations

import enum
from typing import Iterable, Optional, Tuple

import attrs

from kvfuzz.allocator.features import Feature, docstring, documented

SeqId = str
"""A sequence id: a request, or one branch of a request after a fork."""

Namespace = Tuple[str, ...]
"""Everything besides tokens that changes K/V (LoRA adapter, cache salt, multimodal content), as ordered parts.

Two sequences may share a cached block only if their namespaces are equal part for part: ``("ab", "c")`` and
``("a", "bc")`` are different namespaces even though their parts concatenate to the same string.
"""

Tokens = Tuple[int, ...]

NULL_BLOCK = -1
"""The block-table entry of a logical block a sliding-window allocator has dropped: no physical block, never read."""


class EvictionOrder(enum.Enum):
    """An eviction policy an allocator may declare in ``Capabilities.eviction_order``.

    ``LRU``: a cached block is evicted, or reused for new content, only while no free block is left, and then the
    least recently released one first; a cache hit takes a block out of the order and its release puts it back as
    the most recent, and the blocks one release frees count as released tail first (vLLM's free queue, kvfuzz's
    allocator).
    """

    LRU = "lru"


def _non_negative(_instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


@attrs.frozen
class KVGroup:
    """One KV-cache group: the layers that share one block table per sequence (vLLM's KV-cache group).

    Invariant kept: ``name`` is non-empty, ``sliding_window`` is None or >= 1, and ``block_size`` is None or >= 1
    (that it is a multiple of the pool's block size is checked against the pool: :func:`group_block_sizes`).
    """

    name: str = attrs.field(validator=attrs.validators.min_len(1))  # "full", "sliding", ...: used in reports
    # Tokens this group's attention reads back (its blocks before ``len - w`` may be NULL_BLOCK); None = full attention.
    sliding_window: Optional[int] = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    # Tokens one block holds in this group: a multiple of the pool's block_size; None = the pool's block_size.
    block_size: Optional[int] = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))


GROUPED_UNSUPPORTED = (
    "swap",
    "host_cache",
    "rollback",
    "lookahead_blocks",
    "fork_copies",
    "remaps_on_step",
    "attention_kernel",
    "complete_caching",
    "eviction_order",
    "dedupes_copied_tail",
)
"""Capabilities kvfuzz does not check together with several KV-cache groups yet: an allocator declaring groups must
leave these at their defaults (vLLM v1 has no swap; the others are refused until kvfuzz checks them per group)."""


def group_block_sizes(groups: Iterable[KVGroup], block_size: int) -> Tuple[int, ...]:
    """The tokens one block holds in each group, in order (``block_size``, the pool's, for a group that leaves it
    None); raises ValueError unless each is a multiple of ``block_size``. The pool's block size is vLLM's
    ``hash_block_size``, the unit prefixes are hashed in, which every group's block size must be a multiple of."""
    groups = tuple(groups)
    sizes = tuple(block_size if group.block_size is None else group.block_size for group in groups)
    wrong = [f"{group.name}: {size}" for group, size in zip(groups, sizes) if size % block_size]
    if wrong:
        raise ValueError(
            f"a KV-cache group's block size must be a multiple of the pool's block size {block_size}, got "
            f"{', '.join(wrong)}"
        )
    return sizes


def _needs_a_window(instance: "Capabilities", _attribute: attrs.Attribute, drops: bool) -> None:
    if not drops:
        return
    windows = [getattr(group, "sliding_window", None) for group in instance.kv_groups] + [instance.sliding_window]
    if all(window is None for window in windows):
        raise ValueError("refusal_drops_window needs a sliding window (sliding_window, or a group's)")


def _needs_host_cache(instance: "Capabilities", _attribute: attrs.Attribute, async_loads: bool) -> None:
    if async_loads and not instance.host_cache:
        raise ValueError("async_loads needs host_cache: the loads it makes wait are host-tier loads")


def _needs_swap(instance: "Capabilities", _attribute: attrs.Attribute, shares: bool) -> None:
    if shares and not instance.swap:
        raise ValueError("shares_host_blocks needs swap: the host blocks it shares are swap-out destinations")


def _group_tuple(groups: Iterable[KVGroup]) -> Tuple[KVGroup, ...]:
    return tuple(groups)


def _kv_groups(instance: "Capabilities", _attribute: attrs.Attribute, groups: Tuple[KVGroup, ...]) -> None:
    if not groups:
        return
    if len(groups) < 2:
        raise ValueError("kv_groups needs two or more groups: one group is the plain contract (use sliding_window)")
    if not all(isinstance(group, KVGroup) for group in groups):
        raise ValueError(f"kv_groups must hold KVGroup values, got {groups!r}")
    names = [group.name for group in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"kv_groups names must differ, got {names}")
    if instance.sliding_window is not None:
        raise ValueError("with kv_groups, sliding_window must be None: each group declares its own window")
    declared = [name for name in GROUPED_UNSUPPORTED if getattr(instance, name)]
    if declared:
        raise ValueError(f"kvfuzz does not check {', '.join(declared)} together with kv_groups yet")


@attrs.frozen
class Capabilities:
    # The docstring is generated from the fields' metadata at import (kvfuzz.allocator.features), below the class.

    fork: bool = attrs.field(
        default=False,
        metadata=documented(Feature.FORKS, "`fork` is driven", "kvfuzz's allocator, HF transformers, vLLM v0"),
    )
    prefix_cache: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.PREFIX_CACHE,
            "`admit` may report cached tokens; full blocks of finished sequences may stay cached",
            "kvfuzz's allocator, vLLM, SGLang, HF transformers with sharing",
        ),
    )
    namespaces: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.PREFIX_CACHE,
            "the machine draws several namespaces (otherwise every request uses `()`), including two whose parts "
            "concatenate alike",
            "kvfuzz's allocator, vLLM, SGLang",
        ),
    )
    swap: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.HOST_TIER,
            "`swap_out` and `swap_in` are driven (only when `num_host_blocks > 0`)",
            "kvfuzz's allocator, vLLM v0",
        ),
    )
    rollback: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.SPECULATIVE, "`rollback` is driven", "kvfuzz's allocator, `examples/simple_allocator.py`"
        ),
    )
    eviction: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.PREFIX_CACHE,
            "`evict` and `reset_cache` are driven (once some sequence has finished), and `reset_cache` runs before "
            "the final leak check",
            "kvfuzz's allocator, vLLM v1, HF transformers with sharing, SGLang",
        ),
    )
    inflight_window: int = attrs.field(
        default=0,
        validator=_non_negative,
        metadata=documented(
            Feature.SCHEDULED_WRITES,
            "W: a block released while step c was the last completed step may still be touched by work issued up "
            "to then, which runs up to step c + W, and is not handed out again (for writing) before step c + W has "
            "completed; kvfuzz makes that late work land exactly then. W = 0 means synchronous",
            "kvfuzz's default allocator and most zoo variants (W = 1), vLLM v1's deferred-free factories (W = 1)",
        ),
    )
    reserved_blocks: int = attrs.field(
        default=0,
        validator=_non_negative,
        metadata=documented(
            Feature.SCHEDULING,
            "a watermark: the allocator may refuse while fewer than this many blocks would stay free, so a refusal "
            "within the reserve is not false",
            "vLLM v0 (1% of the pool)",
        ),
    )
    sliding_window: Optional[int] = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.ge(1)),
        metadata=documented(
            Feature.GROUPS,
            "w ≥ 1: attention reads only the last w positions, and the allocator may drop (map to `NULL_BLOCK`) any "
            "logical block whose positions all lie before `len - w`",
            "kvfuzz's `sliding_window_allocator`, vLLM v1's sliding-window factories",
        ),
    )
    introspection: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.OBSERVATION,
            "the optional queries (`refcount`, `free_blocks`, `cached_blocks`, `pending_blocks`: `Introspectable`) "
            "are implemented",
            "every allocator shipped, except `examples/simple_allocator.py` and the zoo's `OpaqueLeakOnCancel`",
            "#introspection",
        ),
    )
    attention_kernel: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.OBSERVATION,
            "the allocator ships its own paged attention (`ProvidesAttention.paged_attention`), which `kvfuzz run "
            "--kernel allocator` checks",
            "torch's `PagedAttention`",
            "kernels.md",
        ),
    )
    remaps_on_step: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.PREFIX_CACHE,
            "when a step completes, the allocator may swap a running sequence's block for another block holding the "
            "same K/V (de-duplication against its cache, as HF transformers and SGLang do): kvfuzz then re-reads "
            "every running table after `step_completed` and checks each moved position bit for bit",
            "HF transformers with sharing, SGLang",
        ),
    )
    hits_scheduled_writes: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.SCHEDULED_WRITES,
            "a hit may cover K/V that a live sequence writes at the next step, or that a launched step has written "
            "but not completed, since a step's writes land before its reads; the hitting sequence counts as "
            "computed only after that step",
            "vLLM v1 and v0",
            "#a-block-matchable-when-scheduled-three-behaviours",
        ),
    )
    shares_scheduled_blocks: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.SCHEDULED_WRITES,
            "sequences that joined a block this scheduling round may share it while its owner writes exactly the "
            "content they expect (same-round sharing)",
            "vLLM v1 and v0",
            "#a-block-matchable-when-scheduled-three-behaviours",
        ),
    )
    free_lands_scheduled_writes: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.SCHEDULED_WRITES,
            "a scheduled step runs in full, so a `free` (abort) between scheduling and the step still lands the "
            "freed sequence's writes; without it they are withdrawn, and a `preempt` always withdraws them",
            "vLLM v1 and v0",
            "#a-block-matchable-when-scheduled-three-behaviours",
        ),
    )
    free_scheduled: bool = attrs.field(
        default=True,
        metadata=documented(
            Feature.SCHEDULING,
            "False: the engine never frees a sequence whose latest tokens are scheduled but not yet computed (it has "
            "no abort); the machine then frees only computed and swapped-out sequences",
            "none shipped",
        ),
    )
    preempt_scheduled: bool = attrs.field(
        default=True,
        metadata=documented(
            Feature.SCHEDULING,
            "False: the engine never preempts a sequence whose latest tokens are scheduled but not yet computed (an "
            "FCFS scheduler, as vLLM's FCFS policy, picks its victims before scheduling them); the machine then "
            "preempts only computed sequences",
            "False for vLLM v1 (FCFS policy) and vLLM v0, except their `_priority` and `_chunked_prefill` factories",
        ),
    )
    recomputes_in_place: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.SCHEDULED_WRITES,
            "a sequence may rewrite, with identical K/V, slots of a block others share and read (vLLM v0 recomputes "
            "a fully cached prompt's last token inside the cached block); without it only the first fill of a "
            "block matched while scheduled may happen under its sharers, and anything else is bug class 9",
            "vLLM v0 with prefix caching",
        ),
    )
    fork_copies: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.FORKS,
            "`fork` may copy the parent's partial last block instead of sharing it and return the `BlockCopy`; the "
            "child's table then differs from the parent's exactly at the copies' destinations, and a fork needs a "
            "free block, which the no-false-refusal check accounts for",
            "HF transformers with sharing",
        ),
    )
    recomputes_last_token: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.SCHEDULING,
            "`admit` may report a hit covering the whole prompt because the engine recomputes the last token anyway "
            "(it needs one query token to sample from): the next step writes that token again into the block the "
            "table maps, under the exclusive-write rules (`recomputes_in_place` when the block is shared). Without "
            "it, a hit of the whole prompt is a violation (invariant 9)",
            "none shipped: every shipped engine caps a hit below the prompt's length",
            "#a-hit-of-the-whole-prompt-recomputes_last_token",
        ),
    )
    refusal_evicts: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.SCHEDULING,
            "an `OutOfBlocks` refusal may first drop cached, unreferenced blocks (evicting toward the request, then "
            "refusing): those blocks may leave the cached set for the free set; nothing else may change",
            "none shipped",
            "#a-refusal-that-evicts-refusal_evicts",
        ),
    )
    refusal_drops_window: bool = attrs.field(
        default=False,
        validator=_needs_a_window,
        metadata=documented(
            Feature.GROUPS,
            "needs a window (`sliding_window`, or a group's): an `OutOfBlocks` refusal of a `grow` may first drop "
            "(map to `NULL_BLOCK`) blocks of the growing sequence that no later step reads, those whose positions "
            "all lie before `len + 1 - w`, outside the window of the sequence's next token (vLLM's `allocate_slots` "
            "frees out-of-window blocks before it checks for room). They are released as a successful grow releases "
            "them; no other entry or block may change",
            "vLLM v1's sliding-window factories and its hybrid KV cache",
            "#a-refusal-that-drops-out-of-window-blocks-refusal_drops_window",
        ),
    )
    preemption: bool = attrs.field(
        default=True,
        metadata=documented(
            Feature.SCHEDULING,
            "False: the engine never preempts; `preempt` is never called and need not exist",
            "every allocator shipped preempts",
            "#no-preemption-preemptionfalse",
        ),
    )
    single_token_grow: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.SCHEDULING,
            "the engine grows a sequence by exactly one token at a time (decode only, no chunks or drafts): every "
            "`grow` the machine makes appends one token",
            "none shipped",
            "#one-token-per-grow-single_token_grow",
        ),
    )
    lookahead_blocks: int = attrs.field(
        default=0,
        validator=_non_negative,
        metadata=documented(
            Feature.SPECULATIVE,
            "K: a running sequence's table holds at least `ceil(len / block_size)` blocks and at most K more, its "
            "look-ahead blocks (slots allocated ahead of the tokens, for a drafter's K/V, and blocks a rollback "
            "kept). Each is referenced by its sequence alone (never shared by a fork nor matched by a cache hit), "
            "is never listed as cached once released (it holds none of the sequence's tokens), and goes back on "
            "free and preempt like any block; a rollback leaves a prefix of the table. `admit` and `grow` may refuse "
            "for want of the look-ahead: a refusal is false only when the pool covers the tokens' blocks plus K (a "
            "`fork` may give the child look-ahead of its own, so it may need K fresh blocks). K = 0 means exactly "
            "`ceil(len / block_size)` blocks",
            "`lookahead_allocator` (K = 2), vLLM v1's `_spec_decode` factories",
            "#look-ahead-blocks-and-draft-only-rollback",
        ),
    )
    speculative_tokens: Optional[int] = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.ge(1)),
        metadata=documented(
            Feature.SPECULATIVE,
            "k: `rollback` drops only unverified drafts. Of a `grow` of n tokens the last `min(n - 1, k)` are drafts "
            "(the first is the token the previous step sampled, then any known tokens); a rollback drops at most "
            "the drafts of the sequence's latest grow not yet dropped, and the machine rolls back no further. None: "
            "any tokens but the first may be rolled back",
            "vLLM v1's `_spec_decode` factories (k = 3, or 2 with W = 1)",
            "#look-ahead-blocks-and-draft-only-rollback",
        ),
    )
    evict_rounds_up: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.PREFIX_CACHE,
            "`evict(n)` drops whole cached subtrees until at least n blocks are gone (or every evictable block), as "
            "SGLang's `RadixCache.evict` drops whole leaves: it may drop more than n, never fewer while more are "
            "cached, and returns how many it dropped",
            "SGLang",
            "#evict-rounding-up-to-whole-subtrees",
        ),
    )
    targeted_eviction: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.PREFIX_CACHE,
            "`evict_blocks(blocks)` is implemented and driven (vLLM's `evict_blocks`, used by KV connectors and "
            "offloading): the listed blocks that are cached are dropped from the cache, nothing else",
            "kvfuzz's allocator, vLLM v1 (with prefix caching and a KV connector: its `_kv_connector` factory)",
            "#targeted-eviction",
        ),
    )
    complete_caching: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.PREFIX_CACHE,
            "a policy: every full block a completed step wrote stays matchable for its namespace and prefix until "
            "it is evicted or the cache reset, so an admission of that prefix must report it cached",
            "kvfuzz's allocator and vLLM v1, with prefix caching and no sliding window",
            "#complete-caching",
        ),
    )
    eviction_order: Optional[EvictionOrder] = attrs.field(
        default=None,
        metadata=documented(
            Feature.PREFIX_CACHE,
            "a policy, the order in which cached blocks are evicted or reused for new content (`EvictionOrder`), "
            "checked on every eviction and every reuse. `EvictionOrder.LRU`: cached blocks are evicted and reused "
            "least recently released first, and only once no free block is left",
            "kvfuzz's allocator and vLLM v1, with prefix caching (vLLM: no sliding window)",
            "#eviction-order",
        ),
    )
    host_cache: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.HOST_TIER,
            "the allocator keeps a second, host tier of cached blocks in its `num_host_blocks` host blocks: `admit` "
            "may report cached tokens whose K/V it loads from host blocks (`AdmitResult.loads`, landed by the engine "
            "when the next step is launched, before its writes), and at each step launch `take_transfers` orders "
            "stores of device blocks into host blocks, which land when that step completes (or earlier, when "
            "flushed)",
            "vLLM v1's CPU offloading (`kvfuzz.adapters.vllm_offload`), SGLang's HiCache "
            "(`kvfuzz.adapters.sglang.hicache`)",
            "#a-host-cache-tier-host_cache",
        ),
    )
    async_loads: bool = attrs.field(
        default=False,
        validator=_needs_host_cache,
        metadata=documented(
            Feature.HOST_TIER,
            "with `host_cache`: an admission may wait for its loads over several steps, as vLLM's connectors load "
            "asynchronously (`WAITING_FOR_REMOTE_KVS`): `admit` returns `AdmitResult.waits_for_loads`, a table "
            "covering only the cached tokens, and loads into it; the sequence is then loading: it is neither grown, "
            "forked, preempted, swapped nor rolled back, no step computes or reads it, and only `free` may end it. "
            "The loads start at the next launch; the engine, as the worker, performs them at some later point after "
            "a step has completed (any number of steps later) and then reports them with `loads_landed(seq)` "
            "(`AsyncLoads`), also for a sequence freed meanwhile, whose loaded blocks stay in flight until then. A "
            "landed sequence waits to be scheduled: `resume(seq)` allocates the rest of its prompt and returns the "
            "whole table with the same cached tokens (refused with `OutOfBlocks`, changing nothing, when there is no "
            "room); the engine writes the rest at the next step",
            "vLLM v1's CPU offloading without a sync-load budget "
            "(`kvfuzz.adapters.vllm_offload:cpu_offloading_async_loads`)",
            "#asynchronous-loads-async_loads",
        ),
    )
    shares_host_blocks: bool = attrs.field(
        default=False,
        validator=_needs_swap,
        metadata=documented(
            Feature.HOST_TIER,
            "with `swap`: `swap_out` may map a device block to a host block that another swapped-out sequence "
            "already holds, when that host block holds exactly the K/V the block swapped out holds: the same "
            "namespace and tokens up to the end of that full logical block, at the same logical index (vLLM v0's "
            "host allocator deduplicates full blocks by content). The engine still copies the block over it "
            "(identical K/V); a shared host block stays out of the host free set until its last holder is swapped "
            "in or freed. Without it every swap-out takes host blocks no other swapped-out sequence holds",
            "vLLM v0 with prefix caching and host blocks",
            "#deduplication-by-content-shares_host_blocks-and-dedupes_copied_tail",
        ),
    )
    dedupes_copied_tail: bool = attrs.field(
        default=False,
        metadata=documented(
            Feature.FORKS,
            "a `grow` that orders a copy-on-write copy of the sequence's partial tail block may, once that logical "
            "block is full, map instead a block that already holds the same K/V for it (vLLM v0 looks the full "
            "block's content up and drops its fresh copy): the copy's destination is then in no table, unreferenced "
            "and not cached (free, or pending under W > 0), and the copy into it is wasted work, not a write into "
            "anyone's block. The block the table maps must hold the sequence's written positions of that logical "
            "block (checked bit for bit) and receives its remaining writes under the exclusive-write rules. Without "
            "it every copy's destination is in the growing sequence's table, referenced by it alone",
            "vLLM v0 with prefix caching and fork",
            "#deduplication-by-content-shares_host_blocks-and-dedupes_copied_tail",
        ),
    )
    kv_groups: Tuple[KVGroup, ...] = attrs.field(
        default=(),
        converter=_group_tuple,
        validator=_kv_groups,
        metadata=documented(
            Feature.GROUPS,
            "two or more `KVGroup(name, sliding_window, block_size)`: each sequence has one block table per group "
            "(vLLM's KV-cache groups: a model mixing full-attention and sliding-window layers), every group drawing "
            "block ids from the one pool of `num_blocks` blocks (vLLM unifies the groups' page sizes). A block "
            "holds `KVGroup.block_size` tokens in its group (the pool's `block_size` when None; a multiple of it, as "
            "vLLM requires each group's block size to be a multiple of its `hash_block_size`): group g's table "
            "holds `ceil(len / block_size_g)` blocks and position p lives at (`table_g[p // block_size_g]`, "
            "`p % block_size_g`). `block_table`, `AdmitResult.block_table` and `GrowResult.slots` are group 0's; "
            "`group_block_tables` returns every group's table in `kv_groups` order (`GroupedTables`), a "
            "sliding-window group's dropped blocks as `NULL_BLOCK`. `AdmitResult.num_cached_tokens` is the hit of "
            "every group: a hit of n tokens is valid only if each full-attention group's blocks for positions < n, "
            "and each sliding-window group's blocks covering positions [n - w + 1, n) (what the next token reads "
            "besides itself), hold that prefix's K/V for that group; and n is a multiple of every group's block "
            "size (of their lcm, vLLM's `scheduler_block_size`), so that no group's next write lands in a block the "
            "hit took from the cache. A physical block is in at most one group's tables at a time (several "
            "sequences may share it within that group); refcounts count entries of every group. With groups, "
            "`sliding_window` must be None and the capabilities in `GROUPED_UNSUPPORTED` stay off",
            "kvfuzz's `hybrid_allocator` and `hybrid_allocator_sliding_double`, vLLM v1's hybrid coordinator",
            "#several-kv-cache-groups-kv_groups",
        ),
    )


Capabilities.__doc__ = docstring(
    "What an allocator declares it can do; the machine drives only what is declared, and checks the stronger promise "
    "unless the allocator declares the weaker one.",
    attrs.fields(Capabilities),
)


@attrs.frozen
class Slot:
    """One token slot: offset ``offset`` inside physical block ``block``."""

    block: int
    offset: int


@attrs.frozen
class BlockCopy:
    """Copy the whole of physical block ``src`` into physical block ``dst`` (copy-on-write) before writing."""

    src: int
    dst: int


def _int_tuple(values: Iterable[int]) -> Tuple[int, ...]:
    return tuple(values)


def _slot_tuple(slots: Iterable[Slot]) -> Tuple[Slot, ...]:
    return tuple(slots)


def _copy_tuple(copies: Iterable[BlockCopy]) -> Tuple[BlockCopy, ...]:
    return tuple(copies)


def _pair_tuple(pairs: Iterable[Iterable[int]]) -> Tuple[Tuple[int, int], ...]:
    return tuple((a, b) for a, b in pairs)


@attrs.frozen
class AdmitResult:
    """What ``admit`` returns: the block table covering every prompt token, and how many leading tokens are cached.

    The first ``num_cached_tokens`` positions already hold their K/V in the table's blocks, or (under
    ``host_cache``) in the host blocks of ``loads``: (host block, device block) pairs the engine copies when it
    launches the next step, before that step writes or reads. The engine writes the rest at the next step.
    ``waits_for_loads`` (only under ``async_loads``, with loads): the admission waits for its loads: the table
    covers only the ``num_cached_tokens`` (``ceil(num_cached_tokens / block_size)`` blocks), the loads land when the
    engine reports them (``loads_landed``), and ``resume`` later allocates the rest of the prompt.
    """

    block_table: Tuple[int, ...] = attrs.field(converter=_int_tuple)
    num_cached_tokens: int = attrs.field(validator=_non_negative)
    loads: Tuple[Tuple[int, int], ...] = attrs.field(converter=_pair_tuple, factory=tuple)
    waits_for_loads: bool = False


@attrs.frozen
class GrowResult:
    """What ``grow`` returns: one slot per appended token, and the copies the engine must perform before writing."""

    slots: Tuple[Slot, ...] = attrs.field(converter=_slot_tuple)
    copies: Tuple[BlockCopy, ...] = attrs.field(converter=_copy_tuple, factory=tuple)


@attrs.frozen
class SwapResult:
    """What ``swap_out`` / ``swap_in`` return: (source block, destination block) pairs the engine copies.

    For ``swap_out`` sources are device blocks and destinations host blocks; for ``swap_in`` the reverse.
    """

    mapping: Tuple[Tuple[int, int], ...] = attrs.field(converter=lambda pairs: tuple(tuple(p) for p in pairs))


@attrs.frozen
class HostTransfers:
    """What ``take_transfers(step)`` returns when the engine launches ``step``, under ``host_cache``.

    ``stores``: (device block, host block) pairs ordered now. The worker reads each device block until ``step``
    completes, so the engine copies it then, just before ``step_completed(step)``: the allocator must leave the
    device block unwritten and the host block unread until that step completes. ``flushed``: (device block, host
    block) pairs of stores still in flight (ordered at earlier launches, or in ``stores`` now), which the engine
    finishes now, before this step writes (vLLM flushes the store of a block it hands out again).
    """

    stores: Tuple[Tuple[int, int], ...] = attrs.field(converter=_pair_tuple, factory=tuple)
    flushed: Tuple[Tuple[int, int], ...] = attrs.field(converter=_pair_tuple, factory=tuple)


@attrs.frozen
class PoolSpec:
    """The pool geometry kvfuzz asks an allocator factory for: ``factory(spec) -> PagedAllocator``."""

    block_size: int = attrs.field(validator=attrs.validators.ge(1))
    num_blocks: int = attrs.field(validator=attrs.validators.ge(1))
    num_host_blocks: int = attrs.field(default=0, validator=_non_negative)
    # The in-flight window W kvfuzz asks for (a campaign swarms it), or None for the factory's own. A factory whose
    # allocator's W is configurable (kvfuzz's own) builds it with this W; any other ignores it: kvfuzz always runs the
    # W the allocator declares.
    inflight_window: Optional[int] = attrs.field(default=None, validator=attrs.validators.optional(_non_negative))
