"""One-bug variants of :class:`~benchmarks.independent.base.LedgerAllocator`, one class per bug report.

Each class changes the base in one place, named in its docstring; the class itself is the factory
(``kvfuzz run --allocator benchmarks.independent.variants:FloorGrowth``). Reports 1 to 18 came with the brief;
19 to 27 are added here. Where the base has no such code path, the docstring says how the report was adapted.
"""

from __future__ import annotations

import heapq
from typing import Collection, Optional, Sequence

from kvfuzz.allocator import (
    AdmitResult,
    BlockCopy,
    GrowResult,
    InvalidArgument,
    Namespace,
    OutOfBlocks,
    PoolSpec,
    SeqId,
    SequenceExists,
    SwapResult,
    Tokens,
    UnknownSequence,
)

from .base import LedgerAllocator, Request


class ForkedFreeReleasesTwice(LedgerAllocator):
    """1. Freeing a forked sequence drops one more reference from the last block it still shares."""

    def end(self, seq: SeqId, op: str) -> Request:
        request = super().end(seq, op)
        if request.forked and request.host is None:
            shared = [block for block in request.table if self.refs[block] > 0]
            if shared:
                self.unpin(shared[-1])
        return request


class CopyOnWriteForForksOnly(LedgerAllocator):
    """2. Copy-on-write only for a tail block a fork made shared; a tail block taken from a cache hit (and made
    partial by a rollback) is written in place, under its other holders and its cache entry."""

    def __init__(self, spec: PoolSpec) -> None:
        super().__init__(spec)
        self.fork_shared: set[int] = set()

    def fork(self, parent: SeqId, child: SeqId) -> None:
        super().fork(parent, child)
        self.fork_shared.update(self.requests[child].table)

    def needs_copy(self, request: Request, block: int) -> bool:
        return block in self.fork_shared and super().needs_copy(request, block)


class FloorGrowth(LedgerAllocator):
    """3. Growth computes the blocks needed with floor division: one block short unless the length is a multiple."""

    def blocks_after_growth(self, num_tokens: int) -> int:
        return num_tokens // self.block_size


class EvictChecksNeighbourRefcount(LedgerAllocator):
    """4. ``evict`` scans every cached block and checks the refcount of the block scanned before the candidate, so
    it may evict (send to the free heap) a block a running sequence still holds."""

    def evict(self, num_blocks: int) -> int:
        cached = list(self.digest_of)
        dropped = 0
        for position, block in enumerate(cached):
            if dropped >= num_blocks:
                break
            checked = cached[position - 1] if position else block
            if self.refs[checked] != 0:
                continue
            self.evictable.pop(block, None)
            self.forget(block)
            heapq.heappush(self.free_heap, block)
            dropped += 1
        return dropped


class PreemptKeepsScheduledDigest(LedgerAllocator):
    """5. Preemption releases the blocks but does not retire the request, so the digest queued for the block it was
    filling is still registered when the step completes, though preemption withdrew the write. (Adapted: the base
    digests full blocks only, so the stale digest is the queued one of the block the withdrawn write would have
    completed.)"""

    def preempt(self, seq: SeqId) -> None:
        request = self.running(seq, "preempt")
        del self.requests[seq]
        self.release(request.table)


class SwapInReversed(LedgerAllocator):
    """6. Swap-in maps the host blocks back in reverse order for sequences of more than two blocks."""

    def swap_in_mapping(self, hosts: Sequence[int], devices: Sequence[int]) -> list[tuple[int, int]]:
        if len(hosts) > 2:
            return list(zip(reversed(hosts), devices))
        return super().swap_in_mapping(hosts, devices)


class RollbackKeepsTable(LedgerAllocator):
    """7. Rollback releases the trailing blocks but leaves them in the block table."""

    def rollback(self, seq: SeqId, num_tokens: int) -> None:
        request = self.running(seq, "rollback")
        if not 1 <= num_tokens < len(request.tokens):
            raise InvalidArgument(f"rollback: cannot drop {num_tokens} of {len(request.tokens)} tokens of {seq!r}")
        kept = len(request.tokens) - num_tokens
        self.release(request.table[self.blocks_kept(kept) :])
        del request.tokens[kept:]
        del request.digests[kept // self.block_size :]


class CancelUngrownLeaks(LedgerAllocator):
    """8. Freeing a request admitted but never grown forgets it without releasing its blocks."""

    def free(self, seq: SeqId) -> None:
        request = self.requests.get(seq)
        if request is not None and not request.grown and not request.forked and request.host is None:
            del self.requests[seq]
            request.alive = False
            return
        super().free(seq)


class DigestWithoutParent(LedgerAllocator):
    """9. A block's cache key hashes its namespace and own tokens, not its parent's key."""

    def digest(self, parent: Optional[bytes], namespace: Namespace, block_tokens: Sequence[int]) -> bytes:
        return super().digest(None, namespace, block_tokens)


class ForkAliasesTable(LedgerAllocator):
    """10. Fork gives the child the parent's table list itself, not a copy."""

    def fork(self, parent: SeqId, child: SeqId) -> None:
        if child in self.requests:
            raise SequenceExists(f"fork: child {child!r} is live")
        source = self.running(parent, "fork")
        for block in source.table:
            self.pin(block)
        self.requests[child] = Request(
            source.namespace, list(source.tokens), source.table, list(source.digests), forked=True
        )


class AdmitRefusalKeepsTaken(LedgerAllocator):
    """11. Admission takes fresh blocks one by one and refuses when the pool runs dry, keeping those it took."""

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        if seq in self.requests:
            raise SequenceExists(f"admit: sequence {seq!r} is live")
        if not tokens:
            raise InvalidArgument(f"admit: sequence {seq!r} has no tokens")
        request = Request(tuple(namespace), list(tokens), [], [])
        self.extend_digests(request)
        hits = self.lookup(request)
        for block in hits:
            self.pin(block)
        fresh: list[int] = []
        for _ in range(self.blocks_for(len(tokens)) - len(hits)):
            if not self.spare():
                self.release(hits)
                raise OutOfBlocks(f"admit {seq!r}: the pool ran dry")
            fresh.append(self.take())
        request.table = hits + fresh
        self.requests[seq] = request
        self.queue_full_blocks(request, len(hits))
        return AdmitResult(request.table, num_cached_tokens=len(hits) * self.block_size)


class HitStaysEvictable(LedgerAllocator):
    """12. A hit on an unreferenced cached block does not take it out of the evictable dict."""

    def pin(self, block: int) -> None:
        self.refs[block] += 1


class LastHitUncounted(LedgerAllocator):
    """13. A cache hit does not add a reference to the last block of the hit."""

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
        for block in hits[:-1]:
            self.pin(block)
        request.table = hits + [self.take() for _ in range(needed)]
        self.requests[seq] = request
        self.queue_full_blocks(request, len(hits))
        return AdmitResult(request.table, num_cached_tokens=len(hits) * self.block_size)


class SwapOutZeroesShared(LedgerAllocator):
    """14. Swap-out releases every block of the table to zero references, shared ones included."""

    def swap_out(self, seq: SeqId) -> SwapResult:
        request = self.running(seq, "swap_out")
        count = len(request.table)
        if count > len(self.host_free):
            raise OutOfBlocks(
                f"swap_out {seq!r}: needs {count} host blocks", needed=count, available=len(self.host_free)
            )
        hosts = [self.host_free.pop() for _ in range(count)]
        mapping = list(zip(request.table, hosts))
        for block in reversed(request.table):
            self.refs[block] = 1
            self.unpin(block)
        request.table, request.host = [], hosts
        return SwapResult(mapping)


class RollbackBoundaryOneShort(LedgerAllocator):
    """15. A rollback that ends exactly on a block boundary releases one block too many."""

    def blocks_kept(self, num_tokens: int) -> int:
        kept = self.blocks_for(num_tokens)
        return kept - 1 if num_tokens % self.block_size == 0 else kept


class ReleaseIgnoresCache(LedgerAllocator):
    """16. A released block goes to the free heap even when the cache names it, and the entry outlives its reuse."""

    def unpin(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            heapq.heappush(self.free_heap, block)


class CopyOnWriteWrongWay(LedgerAllocator):
    """17. Copy-on-write goes the wrong way: the writer keeps the original tail block, the other holders move to the
    copy, and the cache entry still names the original, which the writer now rewrites (a block only the cache
    shares is written in place)."""

    def copy_tail(self, request: Request) -> list[BlockCopy]:
        source = request.table[-1]
        if self.refs[source] == 1:
            return []
        target = self.take()
        moved = 0
        for other in self.requests.values():
            if other is request:
                continue
            for index, block in enumerate(other.table):
                if block == source:
                    other.table[index] = target
                    moved += 1
        self.refs[target] = moved
        self.refs[source] -= moved
        return [BlockCopy(src=source, dst=target)]


class CapacityCountsCachedTwice(LedgerAllocator):
    """18. The capacity check counts unreferenced cached blocks twice (as unreferenced, and again as evictable), so
    a call it admits can run dry halfway through its allocation."""

    def spare(self) -> int:
        unreferenced = sum(1 for count in self.refs if count == 0)
        return unreferenced + len(self.evictable)


class RepeatedFreeRequeues(LedgerAllocator):
    """19. A second ``free`` of a finished sequence releases its blocks again instead of refusing."""

    def __init__(self, spec: PoolSpec) -> None:
        super().__init__(spec)
        self.finished: dict[SeqId, Request] = {}

    def free(self, seq: SeqId) -> None:
        if seq not in self.requests and seq in self.finished:
            self.release(self.finished[seq].table)
            return
        self.finished[seq] = self.end(seq, "free")


class FreeCountOffByOne(LedgerAllocator):
    """20. ``free_blocks`` leaves out one free block (a slice starting at 1)."""

    def free_blocks(self) -> Collection[int]:
        return self.free_heap[1:]


class EvictReportsRequested(LedgerAllocator):
    """21. ``evict(n)`` returns n, whatever it dropped."""

    def evict(self, num_blocks: int) -> int:
        super().evict(num_blocks)
        return num_blocks


class WholePromptHit(LedgerAllocator):
    """22. The hit limit is the prompt's full blocks: a prompt of whole blocks can be hit entirely."""

    def hit_limit(self, num_tokens: int) -> int:
        return num_tokens // self.block_size


class NamespaceBlindDigest(LedgerAllocator):
    """23. The cache key leaves out the namespace (LoRA adapter, salt)."""

    def digest(self, parent: Optional[bytes], namespace: Namespace, block_tokens: Sequence[int]) -> bytes:
        return super().digest(parent, (), block_tokens)


class SwappedFreeLeaksHost(LedgerAllocator):
    """24. Freeing a swapped-out sequence forgets to return its host blocks."""

    def end(self, seq: SeqId, op: str) -> Request:
        request = self.requests.get(seq)
        if request is None:
            raise UnknownSequence(f"{op}: no live sequence {seq!r}")
        del self.requests[seq]
        if request.host is None:
            self.release(request.table)
        request.alive = False
        return request


class RegisterWhenScheduled(LedgerAllocator):
    """25. Full blocks are registered in the cache when their writes are scheduled, not when the step completes."""

    def queue_full_blocks(self, request: Request, start: int) -> None:
        for index in range(start, len(request.digests)):
            self.register(request.table[index], request.digests[index])


class RollbackKeepsPartialDigest(LedgerAllocator):
    """26. Rollback truncates the digests with ceiling division, keeping the digest of the block it made partial:
    refilled with other tokens, that block keeps its old digest, and the blocks after it chain on it."""

    def rollback(self, seq: SeqId, num_tokens: int) -> None:
        request = self.running(seq, "rollback")
        if not 1 <= num_tokens < len(request.tokens):
            raise InvalidArgument(f"rollback: cannot drop {num_tokens} of {len(request.tokens)} tokens of {seq!r}")
        kept = len(request.tokens) - num_tokens
        keep = self.blocks_kept(kept)
        self.release(request.table[keep:])
        del request.table[keep:]
        del request.tokens[kept:]
        del request.digests[self.blocks_for(kept) :]


class GrowIgnoresEvictable(LedgerAllocator):
    """27. ``grow`` checks room against the free heap alone, so it refuses while evictable blocks would serve it."""

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        request = self.running(seq, "grow")
        if tokens:
            old = len(request.tokens)
            copy = old % self.block_size != 0 and self.needs_copy(request, request.table[-1])
            needed = self.blocks_after_growth(old + len(tokens)) - len(request.table) + int(copy)
            if needed > len(self.free_heap):
                raise OutOfBlocks(f"grow {seq!r}: needs {needed} blocks", needed=needed, available=len(self.free_heap))
        return super().grow(seq, tokens)
