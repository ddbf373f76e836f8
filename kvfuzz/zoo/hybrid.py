"""Slips of an allocator with several KV-cache groups (vLLM's hybrid models), one realistic step away from kvfuzz's
hybrid allocator."""

from __future__ import annotations

from kvfuzz.allocator.hybrid import HybridAllocator
from kvfuzz.allocator.types import NULL_BLOCK, AdmitResult, Namespace, SeqId, Tokens


class HybridHitFromFullGroup(HybridAllocator):
    """Takes the full-attention group's longest cached prefix as the hit of every group: where the sliding-window
    group's blocks of that window were dropped or evicted, it maps fresh, unwritten blocks there and reports them
    cached."""

    def _hit_blocks(self, matched: list[dict[int, int]], num_tokens: int) -> int:
        hit = 0
        while hit < (num_tokens - 1) // self.block_size and hit in matched[0]:
            hit += 1
        return hit


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
