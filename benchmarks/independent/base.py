"""A correct paged KV-cache allocator written from docs/contract.md alone: the base every variant breaks once.

Structures (chosen to differ from kvfuzz's own allocator):

* free blocks are a min-heap of block ids (the lowest id is handed out first);
* the prefix cache is a pair of dicts, chain digest -> block and block -> chain digest; a digest is a BLAKE2b of
  the parent block's digest, the namespace and the block's tokens, so equal digests mean equal namespace and prefix;
* unreferenced cached blocks wait in an ``OrderedDict`` in release order, oldest first: they are evicted (on request,
  or when the free heap runs dry) oldest first;
* a full block is registered in the cache only when a step completes after the writes that filled it were scheduled
  (the in-flight window is 0, so the step that completes is the one that wrote them), and only if the sequence that
  scheduled them still maps that block, at that index, with the same digest.

Invariants kept after every call: ``refs[b]`` is the number of table entries naming ``b``; every block is exactly one
of referenced, in the free heap, or in the evictable dict; a block in the free heap has no digest; a block is written
only while its writer references it alone and no digest names it (copy-on-write otherwise, the copy's source left
untouched); a hit never covers the block of the prompt's last token. A refused call (``OutOfBlocks`` or a ``Misuse``)
is decided before anything changes.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from typing import Collection, Optional, Sequence

import attrs

from kvfuzz.allocator import (
    AdmitResult,
    BlockCopy,
    Capabilities,
    GrowResult,
    InvalidArgument,
    Namespace,
    OutOfBlocks,
    PoolSpec,
    SeqId,
    SequenceExists,
    Slot,
    SwapResult,
    Tokens,
    UnknownSequence,
)


@attrs.define(eq=False)
class Request:
    """One live sequence. ``table`` is empty while swapped out, and ``host`` then lists its host blocks in order.

    ``digests[i]`` is the chain digest of full logical block i (one per full block of ``tokens``). ``alive`` turns
    False when the request is freed or preempted, so that writes it scheduled are not registered afterwards.
    """

    namespace: Namespace
    tokens: list[int]
    table: list[int]
    digests: list[bytes]
    host: Optional[list[int]] = None
    alive: bool = True
    grown: bool = False
    forked: bool = False


@attrs.frozen
class Registration:
    """Register ``block`` under ``digest`` when the next step completes, if ``request`` still maps it at ``index``."""

    request: Request
    index: int
    block: int
    digest: bytes


class LedgerAllocator:
    """Refcounted, prefix-caching, copy-on-write paged allocator with fork, swap, rollback, preemption, eviction."""

    def __init__(self, spec: PoolSpec) -> None:
        self.block_size = spec.block_size
        self.num_blocks = spec.num_blocks
        self.num_host_blocks = spec.num_host_blocks
        self.capabilities = Capabilities(
            fork=True,
            prefix_cache=True,
            namespaces=True,
            swap=spec.num_host_blocks > 0,
            rollback=True,
            eviction=True,
            targeted_eviction=True,
            introspection=True,
            inflight_window=0,
        )
        self.refs = [0] * spec.num_blocks
        self.free_heap = list(range(spec.num_blocks))  # sorted, hence already a heap
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.block_of: dict[bytes, int] = {}
        self.digest_of: dict[int, bytes] = {}
        self.requests: dict[SeqId, Request] = {}
        self.queued: list[Registration] = []
        self.host_free = list(range(spec.num_host_blocks))

    # -- arithmetic and digests ----------------------------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: the ceiling of the division."""
        return -(-num_tokens // self.block_size)

    def blocks_after_growth(self, num_tokens: int) -> int:
        """Blocks a sequence grown to ``num_tokens`` tokens needs."""
        return self.blocks_for(num_tokens)

    def digest(self, parent: Optional[bytes], namespace: Namespace, block_tokens: Sequence[int]) -> bytes:
        """The chain digest of a full block: its parent's digest, the namespace and its own tokens."""
        h = hashlib.blake2b(digest_size=16)
        h.update(parent if parent is not None else b"root")
        h.update(repr(namespace).encode())
        h.update(repr(tuple(block_tokens)).encode())
        return h.digest()

    def extend_digests(self, request: Request) -> None:
        """Append the digests of the full blocks of ``request.tokens`` not yet digested."""
        size = self.block_size
        for index in range(len(request.digests), len(request.tokens) // size):
            parent = request.digests[index - 1] if index else None
            request.digests.append(
                self.digest(parent, request.namespace, request.tokens[index * size : (index + 1) * size])
            )

    def hit_limit(self, num_tokens: int) -> int:
        """The most full blocks a hit may cover for a prompt of ``num_tokens``: never the block of its last token."""
        return (num_tokens - 1) // self.block_size

    def lookup(self, request: Request) -> list[int]:
        """The cached blocks matching the longest prefix of ``request``'s full blocks, within the hit limit."""
        hits: list[int] = []
        for digest in request.digests[: self.hit_limit(len(request.tokens))]:
            block = self.block_of.get(digest)
            if block is None:
                break
            hits.append(block)
        return hits

    # -- the pool ------------------------------------------------------------------------------------------------

    def spare(self) -> int:
        """Blocks that can be handed out now: free, plus cached and unreferenced (evicted on demand)."""
        return len(self.free_heap) + len(self.evictable)

    def available_besides(self, hits: Sequence[int]) -> int:
        """Blocks available for fresh allocation once ``hits`` are pinned (an evictable hit is no longer spare)."""
        return self.spare() - sum(1 for block in hits if self.refs[block] == 0)

    def take(self) -> int:
        """A fresh block, referenced once: the lowest free id, else the oldest evictable block, uncached."""
        if self.free_heap:
            block = heapq.heappop(self.free_heap)
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            self.forget(block)
        else:
            raise OutOfBlocks("no block left to hand out", needed=1, available=0)
        self.refs[block] = 1
        return block

    def pin(self, block: int) -> None:
        """One more reference to a cached or shared block (an unreferenced one leaves the evictable dict)."""
        self.evictable.pop(block, None)
        self.refs[block] += 1

    def unpin(self, block: int) -> None:
        """One reference fewer; an unreferenced block goes to the evictable dict when cached, else to the heap."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.digest_of:
                self.evictable[block] = None
            else:
                heapq.heappush(self.free_heap, block)

    def release(self, table: Sequence[int]) -> None:
        """Drop one reference to every block of ``table``, last block first."""
        for block in reversed(table):
            self.unpin(block)

    def forget(self, block: int) -> None:
        """Drop ``block``'s cache entry, if it has one."""
        digest = self.digest_of.pop(block, None)
        if digest is not None and self.block_of.get(digest) == block:
            del self.block_of[digest]

    def drop_evictable(self, block: int) -> None:
        """Evict one unreferenced cached block into the free heap."""
        del self.evictable[block]
        self.forget(block)
        heapq.heappush(self.free_heap, block)

    def queue_full_blocks(self, request: Request, start: int) -> None:
        """Queue the registration of ``request``'s full blocks from logical block ``start`` on."""
        for index in range(start, len(request.digests)):
            self.queued.append(Registration(request, index, request.table[index], request.digests[index]))

    def slots(self, request: Request, start: int, stop: int) -> list[Slot]:
        size = self.block_size
        return [Slot(request.table[p // size], p % size) for p in range(start, stop)]

    # -- look-ups that refuse ------------------------------------------------------------------------------------

    def running(self, seq: SeqId, op: str) -> Request:
        request = self.requests.get(seq)
        if request is None:
            raise UnknownSequence(f"{op}: no live sequence {seq!r}")
        if request.host is not None:
            raise InvalidArgument(f"{op}: sequence {seq!r} is swapped out")
        return request

    def swapped(self, seq: SeqId, op: str) -> Request:
        request = self.requests.get(seq)
        if request is None:
            raise UnknownSequence(f"{op}: no live sequence {seq!r}")
        if request.host is None:
            raise InvalidArgument(f"{op}: sequence {seq!r} is not swapped out")
        return request

    # -- the contract --------------------------------------------------------------------------------------------

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        if seq in self.requests:
            raise SequenceExists(f"admit: sequence {seq!r} is live")
        if not tokens:
            raise InvalidArgument(f"admit: sequence {seq!r} has no tokens")
        request = Request(tuple(namespace), list(tokens), [], [])
        self.extend_digests(request)
        hits = self.lookup(request)
        needed = self.blocks_for(len(tokens)) - len(hits)
        available = self.available_besides(hits)
        if needed > available:
            raise OutOfBlocks(f"admit {seq!r}: needs {needed} blocks", needed=needed, available=available)
        for block in hits:
            self.pin(block)
        request.table = hits + [self.take() for _ in range(needed)]
        self.requests[seq] = request
        self.queue_full_blocks(request, len(hits))
        return AdmitResult(request.table, num_cached_tokens=len(hits) * self.block_size)

    def needs_copy(self, request: Request, block: int) -> bool:
        """Whether writing into ``block`` (``request``'s partial tail) needs a copy first: shared, or cached."""
        return self.refs[block] > 1 or block in self.digest_of

    def copy_tail(self, request: Request) -> list[BlockCopy]:
        """Copy-on-write of ``request``'s partial tail: the writer moves to a fresh copy; the source is untouched."""
        source = request.table[-1]
        target = self.take()
        self.unpin(source)
        request.table[-1] = target
        return [BlockCopy(src=source, dst=target)]

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        request = self.running(seq, "grow")
        if not tokens:
            raise InvalidArgument(f"grow: no tokens for {seq!r}")
        old = len(request.tokens)
        new = old + len(tokens)
        copy = old % self.block_size != 0 and self.needs_copy(request, request.table[-1])
        needed = self.blocks_after_growth(new) - len(request.table) + int(copy)
        if needed > self.spare():
            raise OutOfBlocks(f"grow {seq!r}: needs {needed} blocks", needed=needed, available=self.spare())
        copies = self.copy_tail(request) if copy else []
        request.table.extend(self.take() for _ in range(self.blocks_after_growth(new) - len(request.table)))
        request.tokens.extend(tokens)
        request.grown = True
        first_new_full = len(request.digests)
        self.extend_digests(request)
        self.queue_full_blocks(request, first_new_full)
        return GrowResult(self.slots(request, old, new), copies)

    def fork(self, parent: SeqId, child: SeqId) -> None:
        if child in self.requests:
            raise SequenceExists(f"fork: child {child!r} is live")
        source = self.running(parent, "fork")
        for block in source.table:
            self.pin(block)
        self.requests[child] = Request(
            source.namespace, list(source.tokens), list(source.table), list(source.digests), forked=True
        )
        return None

    def end(self, seq: SeqId, op: str) -> Request:
        """Remove ``seq``, releasing its device or host blocks."""
        request = self.requests.get(seq)
        if request is None:
            raise UnknownSequence(f"{op}: no live sequence {seq!r}")
        del self.requests[seq]
        if request.host is not None:
            self.host_free.extend(request.host)
        else:
            self.release(request.table)
        request.alive = False
        return request

    def free(self, seq: SeqId) -> None:
        self.end(seq, "free")

    def preempt(self, seq: SeqId) -> None:
        self.running(seq, "preempt")
        self.end(seq, "preempt")

    def swap_out(self, seq: SeqId) -> SwapResult:
        request = self.running(seq, "swap_out")
        count = len(request.table)
        if count > len(self.host_free):
            raise OutOfBlocks(
                f"swap_out {seq!r}: needs {count} host blocks", needed=count, available=len(self.host_free)
            )
        hosts = [self.host_free.pop() for _ in range(count)]
        mapping = list(zip(request.table, hosts))
        self.release(request.table)
        request.table, request.host = [], hosts
        return SwapResult(mapping)

    def swap_in(self, seq: SeqId) -> SwapResult:
        request = self.swapped(seq, "swap_in")
        hosts = request.host or []
        if len(hosts) > self.spare():
            raise OutOfBlocks(f"swap_in {seq!r}: needs {len(hosts)} blocks", needed=len(hosts), available=self.spare())
        request.table = [self.take() for _ in hosts]
        mapping = self.swap_in_mapping(hosts, request.table)
        self.host_free.extend(hosts)
        request.host = None
        return SwapResult(mapping)

    def swap_in_mapping(self, hosts: Sequence[int], devices: Sequence[int]) -> list[tuple[int, int]]:
        """(host block, device block) pairs: logical block i comes back from ``hosts[i]`` into ``devices[i]``."""
        return list(zip(hosts, devices))

    def rollback(self, seq: SeqId, num_tokens: int) -> None:
        request = self.running(seq, "rollback")
        if not 1 <= num_tokens < len(request.tokens):
            raise InvalidArgument(f"rollback: cannot drop {num_tokens} of {len(request.tokens)} tokens of {seq!r}")
        kept = len(request.tokens) - num_tokens
        keep = self.blocks_kept(kept)
        self.release(request.table[keep:])
        del request.table[keep:]
        del request.tokens[kept:]
        del request.digests[kept // self.block_size :]

    def blocks_kept(self, num_tokens: int) -> int:
        """Blocks a sequence rolled back to ``num_tokens`` tokens keeps."""
        return self.blocks_for(num_tokens)

    def evict(self, num_blocks: int) -> int:
        victims = list(self.evictable)[: max(num_blocks, 0)]
        for block in victims:
            self.drop_evictable(block)
        return len(victims)

    def reset_cache(self) -> None:
        self.evict(len(self.evictable))

    def evict_blocks(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if block in self.evictable:
                self.drop_evictable(block)

    def step_completed(self, step: int) -> None:
        """The step has written every token scheduled before it: register the full blocks still as scheduled."""
        queued, self.queued = self.queued, []
        for item in queued:
            if self.still_scheduled(item):
                self.register(item.block, item.digest)

    def still_scheduled(self, item: Registration) -> bool:
        request = item.request
        return (
            request.alive
            and request.host is None
            and item.index < len(request.digests)
            and request.table[item.index] == item.block
            and request.digests[item.index] == item.digest
        )

    def register(self, block: int, digest: bytes) -> None:
        """Name ``block`` in the cache by ``digest``, unless the digest or the block already has an entry."""
        if digest not in self.block_of and block not in self.digest_of:
            self.block_of[digest] = block
            self.digest_of[block] = digest

    def block_table(self, seq: SeqId) -> tuple[int, ...]:
        request = self.requests.get(seq)
        if request is None:
            raise UnknownSequence(f"block_table: no live sequence {seq!r}")
        return tuple(request.table)

    # -- introspection -------------------------------------------------------------------------------------------

    def refcount(self, block: int) -> int:
        return self.refs[block]

    def free_blocks(self) -> Collection[int]:
        return self.free_heap

    def cached_blocks(self) -> Collection[int]:
        return self.evictable.keys()

    def pending_blocks(self) -> Collection[int]:
        return ()

    def host_free_blocks(self) -> Collection[int]:
        return self.host_free


def factory(spec: PoolSpec) -> LedgerAllocator:
    """``kvfuzz run --allocator benchmarks.independent.base:factory``."""
    return LedgerAllocator(spec)
