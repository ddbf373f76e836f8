"""The protocol a paged KV-cache allocator implements to be driven by kvfuzz.

kvfuzz plays the serving engine: it calls these operations between steps, writes K/V where the allocator says,
performs the copies it orders, and tells it when each step has completed. :class:`AllocatorProtocol` holds what every
allocator has; each optional capability has a protocol of its own (:data:`CAPABILITY_PROTOCOLS`), whose methods the
allocator has when it declares that capability in ``capabilities``. kvfuzz never calls a method whose capability is
not declared, so the method need not exist (an allocator that keeps a stub raising
:class:`~kvfuzz.allocator.errors.Unsupported` still works).

Rules every implementation keeps:

* A refusal (any :class:`~kvfuzz.allocator.errors.AllocatorError`) changes nothing observable.
* ``block_table(seq)`` holds exactly ``ceil(len(tokens) / block_size)`` blocks, or up to
  ``capabilities.lookahead_blocks`` more (look-ahead blocks, owned by the sequence alone and never cached); position
  ``p`` lives in slot ``(table[p // block_size], p % block_size)``.
* A block that will receive a write is referenced by that sequence alone (copy-on-write happened first).
* A prefix-cache hit covers only blocks whose K/V a completed step wrote, for the same namespace and token prefix.
* ``fork`` and ``swap_out`` are called only on a sequence whose every token has been computed by a step.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Collection, Mapping, Optional, Protocol, Sequence, runtime_checkable

from kvfuzz.allocator.types import (
    AdmitResult,
    BlockCopy,
    Capabilities,
    GrowResult,
    HostTransfers,
    Namespace,
    SeqId,
    SwapResult,
    Tokens,
)

if TYPE_CHECKING:
    import torch


@runtime_checkable
class AllocatorProtocol(Protocol):
    """A paged KV-cache block manager: what every allocator has, whatever it declares (:data:`CORE_METHODS`)."""

    block_size: int
    num_blocks: int
    num_host_blocks: int
    capabilities: Capabilities

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        """Allocate blocks for a prompt, reusing cached blocks for a matching prefix."""

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        """Append ``len(tokens) >= 1`` tokens; return their slots and any block copies to perform first."""

    def free(self, seq: SeqId) -> None:
        """Finish or cancel ``seq`` (at any moment, even before its first step). Full blocks may stay cached."""

    def step_completed(self, step: int) -> None:
        """Step ``step`` (counted from 0) has finished on the device: every write and read it issued is done."""

    def block_table(self, seq: SeqId) -> Sequence[int]:
        """The physical blocks of ``seq``'s logical blocks, in order."""


@runtime_checkable
class Preempts(Protocol):
    """Optional: the engine preempts by recomputation; comes with ``capabilities.preemption`` (declared by default)."""

    def preempt(self, seq: SeqId) -> None:
        """Release ``seq`` for recomputation; the engine admits it again later under the same id."""


@runtime_checkable
class Forks(Protocol):
    """Optional: a sequence shares its blocks with a new one (parallel sampling, beam search); the allocator sets
    ``capabilities.fork``."""

    def fork(self, parent: SeqId, child: SeqId) -> Optional[Sequence[BlockCopy]]:
        """Make ``child`` share every block of ``parent`` (same tokens, same namespace).

        An allocator may instead give the child a copy of some block (HF transformers copies the partial last block):
        it returns those copies, and the child's table differs from the parent's exactly at their destinations.
        Returning None means every block is shared."""


@runtime_checkable
class Swaps(Protocol):
    """Optional: a sequence's blocks move to the host pool and back; the allocator sets ``capabilities.swap``."""

    def swap_out(self, seq: SeqId) -> SwapResult:
        """Move ``seq``'s blocks to the host pool; returns (device block, host block) copies to perform."""

    def swap_in(self, seq: SeqId) -> SwapResult:
        """Bring a swapped-out ``seq`` back; returns (host block, device block) copies to perform."""


@runtime_checkable
class RollsBack(Protocol):
    """Optional: rejected speculative drafts are dropped; the allocator sets ``capabilities.rollback``."""

    def rollback(self, seq: SeqId, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` tokens of ``seq`` (rejected speculative drafts); keeps at least one token.

        The table left is a prefix of the table before; blocks of dropped tokens may stay as look-ahead blocks, up
        to ``capabilities.lookahead_blocks``."""


@runtime_checkable
class Evicts(Protocol):
    """Optional: cached blocks are dropped on request; the allocator sets ``capabilities.eviction``."""

    def evict(self, num_blocks: int) -> int:
        """Drop up to ``num_blocks`` cached, unreferenced blocks; return how many were dropped."""

    def reset_cache(self) -> None:
        """Drop every cached, unreferenced block."""


@runtime_checkable
class EvictsBlocks(Protocol):
    """Optional: targeted eviction by block id (vLLM's ``evict_blocks``, used by KV connectors and offloading); an
    allocator that implements it sets ``capabilities.targeted_eviction``."""

    def evict_blocks(self, blocks: Sequence[int]) -> None:
        """Drop from the cache those of ``blocks`` (all unreferenced) that are cached; leave every other block as it
        is."""


@runtime_checkable
class GroupedTables(Protocol):
    """Optional: the allocator keeps one block table per KV-cache group; it sets ``capabilities.kv_groups``.

    The engine reads every group's table after each operation that may change one (admit, grow, fork, free,
    preempt), and derives each group's slots from its table: position ``p`` of group g lives in
    ``(tables[g][p // block_size], p % block_size)``.
    """

    def group_block_tables(self, seq: SeqId) -> Sequence[Sequence[int]]:
        """One block table per group, in ``capabilities.kv_groups`` order (group 0's equals ``block_table(seq)``);
        ``NULL_BLOCK`` where a sliding-window group dropped a block."""


@runtime_checkable
class Introspectable(Protocol):
    """Optional queries; an allocator that implements them sets ``capabilities.introspection``.

    The collections may be live views of internal state but must be cheap: ``len`` and ``in`` are called after every
    operation. A collection holding a block twice (a double free) is reported, so do not deduplicate it. An allocator
    with a host pool may also implement the optional host query of :class:`HostIntrospectable`.
    """

    def refcount(self, block: int) -> int:
        """How many block-table entries of live sequences reference ``block``."""

    def free_blocks(self) -> Collection[int]:
        """Unreferenced blocks holding nothing reusable, ready to hand out now."""

    def cached_blocks(self) -> Collection[int]:
        """Unreferenced blocks holding reusable cached K/V (evictable)."""

    def pending_blocks(self) -> Collection[int]:
        """Released blocks still inside the in-flight window: neither free nor usable yet."""


@runtime_checkable
class HostIntrospectable(Protocol):
    """Optional beside :class:`Introspectable`, for an allocator with a host pool: its host free set. An allocator
    that declares ``introspection`` and implements this query has its host pool checked like the device pool, whether
    the pool is swap's destination or a cache tier the allocator fills by itself (kvfuzz looks for the method;
    nothing else is declared).

    Like the device sets, the collection may be a live view, must be cheap, and must not be deduplicated.
    """

    def host_free_blocks(self) -> Collection[int]:
        """Host blocks (``0 .. num_host_blocks - 1``, as ``swap_out`` numbers them) that no swapped-out sequence
        holds: free, or holding a cached copy the allocator may hand out again."""


@runtime_checkable
class HostCache(Protocol):
    """Optional: the allocator keeps a host tier of cached blocks; it sets ``capabilities.host_cache``.

    Loads come with ``admit`` (``AdmitResult.loads``); stores are ordered here, once per step launch.
    """

    def take_transfers(self, step: int) -> HostTransfers:
        """Step ``step`` is being launched: the stores ordered now (copied when ``step`` completes) and the earlier
        stores to finish now. The engine then finishes the flushed stores, lands the loads ordered since the previous
        launch, and writes the step's tokens."""


@runtime_checkable
class AsyncLoads(Protocol):
    """Optional: an admission may wait for its host-tier loads over several steps; the allocator sets
    ``capabilities.async_loads`` (with ``host_cache``).

    An admission that returns ``AdmitResult.waits_for_loads`` leaves its sequence loading until the engine reports
    the loads landed, then waiting until ``resume`` schedules it.
    """

    def loads_landed(self, seq: SeqId) -> None:
        """The worker reports every load ordered for ``seq``'s admission done, with the output of the latest completed
        step (vLLM's ``finished_recving``); ``seq`` may have been freed since, and its blocks are released now."""

    def resume(self, seq: SeqId) -> AdmitResult:
        """Schedule ``seq``, whose loads have landed: allocate the rest of its prompt and return its whole table and
        the tokens cached (those its admission reported). ``OutOfBlocks`` when there is no room, changing nothing."""


@runtime_checkable
class ProvidesAttention(Protocol):
    """Optional: the allocator ships its own paged attention; it sets ``capabilities.attention_kernel``.

    kvfuzz writes K/V into its own pools, which stand for the allocator's physical page store: position ``p`` of a
    sequence lives in pool row ``table[p // block_size] * block_size + p % block_size``. ``kvfuzz run --kernel
    allocator`` checks this method against the contiguous reference (invariant 2, within the tolerance of a
    different kernel).
    """

    def paged_attention(
        self,
        queries: "torch.Tensor",
        keys: "torch.Tensor",
        values: "torch.Tensor",
        seqs: Sequence[SeqId],
        lengths: Sequence[int],
        starts: Sequence[int],
    ) -> "torch.Tensor":
        """Attention of each running sequence's last-token query over its own K/V, read through the allocator's
        tables.

        ``queries`` ``[S, L, Hq, D]`` (row i is ``seqs[i]``'s); ``keys``/``values`` the engine's pools
        ``[num_blocks * block_size, L, Hkv, D]``; row i attends to positions ``starts[i] .. lengths[i] - 1``
        (``starts`` > 0 only under a sliding window). Returns ``[S, L, Hq, D]``.
        """


@runtime_checkable
class NamesLibraryBlocks(Protocol):
    """Optional: an adapter whose library numbers blocks differently from the contract (vLLM's null block 0, SGLang's
    padding page) names each block as its library does; ``kvfuzz show`` labels every lane with it."""

    def library_block_name(self, block: int) -> str:
        """Contract block ``block`` as the library names it: ``"vLLM block 4"``."""


def _methods(protocol: type) -> tuple[str, ...]:
    """The methods ``protocol`` itself defines, in the order it defines them."""
    return tuple(name for name, value in vars(protocol).items() if inspect.isfunction(value) and name[0] != "_")


CORE_METHODS: tuple[str, ...] = _methods(AllocatorProtocol)
"""Methods every allocator has, whatever it declares: those of :class:`AllocatorProtocol`."""

CAPABILITY_PROTOCOLS: Mapping[str, type] = {
    "preemption": Preempts,
    "fork": Forks,
    "swap": Swaps,
    "rollback": RollsBack,
    "eviction": Evicts,
    "targeted_eviction": EvictsBlocks,
    "introspection": Introspectable,
    "host_cache": HostCache,
    "async_loads": AsyncLoads,
    "kv_groups": GroupedTables,
}
"""Capability -> the protocol of the methods that come with it. An allocator that declares the capability has
those methods; kvfuzz calls none of them otherwise (misuse probes included), so they need not exist, and narrows to
the protocol only where the declaration guards the call. A capability counts as declared when it is truthy: True, a
positive number, a non-empty tuple (``kv_groups``)."""

DECLARED_METHODS: Mapping[str, tuple[str, ...]] = {
    capability: _methods(protocol) for capability, protocol in CAPABILITY_PROTOCOLS.items()
}
"""Capability -> the methods that come with it, read off :data:`CAPABILITY_PROTOCOLS`."""


def declares(capabilities: Capabilities, method: str) -> bool:
    """Whether an allocator declaring ``capabilities`` has ``method``: a core method, or one its capability brings."""
    return method in CORE_METHODS or any(
        method in methods and bool(getattr(capabilities, capability))
        for capability, methods in DECLARED_METHODS.items()
    )
