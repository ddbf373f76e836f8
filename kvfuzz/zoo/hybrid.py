"""Slips of an allocator with several KV-cache groups (vLLM's hybrid models), one realistic step away from kvfuzz's
hybrid allocator."""

from __future__ import annotations

from typing import Any

from kvfuzz.allocator.hybrid import HybridAllocator
from kvfuzz.allocator.types import NULL_BLOCK, AdmitResult, Namespace, SeqId, Tokens
from kvfuzz.engine.violations import Invariant
from kvfuzz.zoo.entry import Variant


class HybridHitFromFullGroup(HybridAllocator):
    """Takes the full-attention group's longest cached prefix as the hit of every group: where the sliding-window
    group's blocks of that window were dropped or evicted, it maps fresh, unwritten blocks there and reports them
    cached."""

    def _hit_tokens(self, matched: list[dict[int, int]], num_tokens: int) -> int:
        hit = 0
        while hit < (num_tokens - 1) // self.block_size and hit in matched[0]:
            hit += 1
        return hit * self.block_size


class BlockInBothGroups(HybridAllocator):
    """Gives a new prompt's last block to both groups: the sliding-window group maps the full-attention group's last
    block instead of one of its own (a de-duplication across groups), so two layers' K/V land in one block."""

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        result = super().admit(seq, namespace, tokens)
        full, sliding = self._seqs[seq].tables
        if result.num_cached_tokens == 0 and len(tokens) % self.block_size:
            self._pool.take(full[-1])
            self._pool.release(sliding[-1])
            sliding[-1] = full[-1]
        return result


class HitGroupsSwapped(HybridAllocator):
    """Assembles a hit's tables with the groups' cached blocks swapped (a group index mixed up): each group maps the
    other group's block of the same prefix, so its layers read another layer's K/V."""

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        result = super().admit(seq, namespace, tokens)
        full, sliding = self._seqs[seq].tables
        index = result.num_cached_tokens // self.block_size - 1  # the hit's last block, which both groups map
        if index >= 0 and NULL_BLOCK not in (full[index], sliding[index]):
            full[index], sliding[index] = sliding[index], full[index]
            return AdmitResult(tuple(full), result.num_cached_tokens)
        return result


class _SlidingGroupAtTwiceTheBlockSize(HybridAllocator):
    """kvfuzz's hybrid allocator with its sliding-window group at twice the pool's block size (the base of the
    slips below, which get the per-group block arithmetic wrong)."""

    def __init__(self, block_size: int, num_blocks: int, num_host_blocks: int = 0, **options: Any) -> None:
        super().__init__(block_size, num_blocks, num_host_blocks, sliding_block_size=2 * block_size, **options)


class WindowInPoolBlocks(_SlidingGroupAtTwiceTheBlockSize):
    """Finds the sliding-window group's out-of-window blocks in units of the pool's block size rather than the
    group's own (twice as large): it drops blocks that still hold positions inside the window."""

    def _first_kept_index(self, group: int, num_tokens: int) -> int:
        window = self._window(group)
        return 0 if window is None else max(0, num_tokens - window) // self.block_size


class HitInPoolBlocks(_SlidingGroupAtTwiceTheBlockSize):
    """Steps a hit by the pool's block size rather than by every group's (the lcm, vLLM's scheduler block size): a
    hit may end inside a block of the sliding-window group, whose next writes then land in a block the hit shares
    with the cache."""

    def _hit_tokens(self, matched: list[dict[int, int]], num_tokens: int) -> int:
        for hit in range((num_tokens - 1) // self.block_size * self.block_size, 0, -self.block_size):
            if all(
                all(index in found for index in range(self._first_hit_index(group, hit), hit // self._sizes[group]))
                for group, found in enumerate(matched)
            ):
                return hit
        return 0


VARIANTS: tuple[Variant, ...] = (
    Variant(
        HybridHitFromFullGroup,
        "9 hybrid hit taken from the full group alone",
        Invariant.CACHE_SOUNDNESS,
        cause="which an eviction dropped from the cache",
    ),
    Variant(
        BlockInBothGroups, "11 one block in two KV-cache groups", Invariant.REFCOUNTS, cause="KV-cache groups at once"
    ),
    Variant(
        HitGroupsSwapped,
        "11 a hit's blocks given to the wrong KV-cache group",
        Invariant.CACHE_SOUNDNESS,
        cause="differ only in their KV-cache group",
    ),
    Variant(
        WindowInPoolBlocks,
        "11 a group's window found at the pool's block size",
        Invariant.CONTENT,
        cause="which attention still reads",
    ),
    Variant(
        HitInPoolBlocks,
        "11 a hit ending inside a larger group's block",
        Invariant.CACHE_SOUNDNESS,
        cause="which an eviction dropped from the cache",
    ),
)
"""This module's slips, in the zoo's order, each with its bug class and the invariant that must catch it."""
