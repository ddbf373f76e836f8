"""Broken look-ahead allocators: kvfuzz's correct allocator with look-ahead blocks (``lookahead_blocks``), each with one
slip of the kind speculative-decoding paths make. Each docstring names the bug class (docs/invariants.md).

A look-ahead block sits beyond the blocks a sequence's tokens fill: slots reserved for a drafter's K/V, or blocks a
rollback kept for the next drafts. It must be owned by its sequence alone, never matched by a cache hit nor left
cached, returned on free and preempt, and a rollback must leave the blocks of the tokens it keeps where they were.
"""

from __future__ import annotations

from kvfuzz.allocator.errors import InvalidArgument
from kvfuzz.allocator.paged import PagedAllocator, _Sequence
from kvfuzz.allocator.types import NULL_BLOCK, SeqId
from kvfuzz.engine.violations import Invariant
from kvfuzz.zoo.entry import Variant


class LookaheadSharedByFork(PagedAllocator):
    """Class 8, a look-ahead block shared with a fork sibling: fork gives the child every block of the parent's
    table, look-ahead included (the fork path predates look-ahead and copies the whole table), so both siblings'
    next drafts land in one block.
    """

    def fork(self, parent: SeqId, child: SeqId) -> None:
        source = self._running(parent, "fork")
        super().fork(parent, child)
        state = self._seqs[child]
        for block in source.table[len(state.table) :]:
            self._pool.take(block)
        state.table, state.versions = list(source.table), list(source.versions)


class LookaheadKeepsCachedBlock(PagedAllocator):
    """Class 8, a rollback that keeps cached content as look-ahead: the blocks of rejected tokens are kept up to the
    look-ahead whatever they hold, so a full block registered in the prefix cache (or about to be) stays
    matchable while its owner will write other drafts into it.
    """

    def rollback(self, seq: SeqId, num_tokens: int) -> None:
        state = self._running(seq, "rollback")
        if not 1 <= num_tokens < len(state.tokens):
            raise InvalidArgument(f"rollback: {seq!r} holds {len(state.tokens)} tokens, cannot drop {num_tokens}")
        new_len = len(state.tokens) - num_tokens
        keep = self._blocks_for(new_len)
        while keep < min(len(state.table), self._reach(new_len)) and self._pool.refcount(state.table[keep]) == 1:
            keep += 1  # the slip: cached content is not a reason to let the block go
        for block in reversed(state.table[keep:]):
            self._pool.release(block)
        del state.table[keep:], state.versions[keep:], state.tokens[new_len:]
        del state.hashes[new_len // self.block_size :]
        if new_len % self.block_size:
            state.versions[new_len // self.block_size] = next(self._version_clock)


class LookaheadLeakOnFree(PagedAllocator):
    """Class 2, look-ahead blocks leaked on free: the release path walks the blocks that hold the sequence's tokens
    (as a free path written before look-ahead existed does), so the look-ahead blocks keep their reference forever.
    """

    def _release_table(self, state: _Sequence) -> None:
        for block in reversed(state.table[: self._blocks_for(len(state.tokens))]):
            if block != NULL_BLOCK:
                self._pool.release(block)


class RollbackDropsAcceptedBlock(PagedAllocator):
    """Class 8, a rollback that frees a block still holding accepted tokens: it releases the block of the first
    rejected token, ``table[new_len // block_size]``, and closes the gap, though when the kept tokens end inside that
    block it still holds accepted tokens; the table's length stays within the look-ahead, so only where its blocks
    lie shows the slip.
    """

    def rollback(self, seq: SeqId, num_tokens: int) -> None:
        state = self._running(seq, "rollback")
        new_len = len(state.tokens) - num_tokens
        first_rejected = new_len // self.block_size
        if 1 <= num_tokens < len(state.tokens) and new_len % self.block_size and first_rejected + 1 < len(state.table):
            self._pool.release(state.table[first_rejected])
            del state.table[first_rejected], state.versions[first_rejected]
        super().rollback(seq, num_tokens)


VARIANTS: tuple[Variant, ...] = (
    Variant(
        LookaheadSharedByFork,
        "8 look-ahead block shared with a fork sibling",
        Invariant.EXCLUSIVE_WRITES,
        lookahead_blocks=1,
        cause="look-ahead block",
    ),
    Variant(
        LookaheadKeepsCachedBlock,
        "8 rollback keeps cached content as look-ahead",
        Invariant.CACHE_SOUNDNESS,
        lookahead_blocks=2,
        cause="released as a look-ahead block, is listed as cached",
    ),
    Variant(
        LookaheadLeakOnFree,
        "2 look-ahead leaked on free",
        Invariant.REFCOUNTS,
        lookahead_blocks=1,
        cause="has refcount",
    ),
    Variant(
        RollbackDropsAcceptedBlock,
        "8 rollback frees a block holding accepted tokens",
        Invariant.CONTENT,
        lookahead_blocks=2,
        cause="changed the blocks of positions it kept",
    ),
)
"""This module's slips, in the zoo's order, each with its bug class and the invariant that must catch it."""
