"""Invariant 5, exclusive writes: a block the engine writes (a scheduled token, a copy, a load) is referenced by
its writer alone."""

from __future__ import annotations

from kvfuzz.allocator.types import (
    BlockCopy,
)
from kvfuzz.engine.checks.context import Checker
from kvfuzz.engine.violations import Invariant


class ExclusiveWrites(Checker):
    """Invariant 5: no write lands in a block another table entry references (unless it writes the same K/V under a
    declared policy)."""

    def block(self, block: int, seq: str, what: str) -> None:
        holders = self.state.refs.holders.get(block, set())
        others = sorted(holder for holder in holders if holder[0] != seq)
        caps = self.state.caps
        if (
            others
            and (caps.shares_scheduled_blocks or caps.recomputes_in_place)
            and self._same_content(block, seq, holders)
        ):
            return
        if others or len(holders) != 1:
            self.fail(
                Invariant.EXCLUSIVE_WRITES,
                f"{what} into block {block} while it is shared",
                [
                    f"expected: block {block} referenced by {self.state.label(seq) if caps.kv_groups else seq} alone "
                    "(copy-on-write first)",
                    f"found:    referenced by {self.state.entries(holders)}",
                    *self.pools.block_story(block),
                ],
            )

    def _same_content(self, block: int, seq: str, holders: set) -> bool:
        """Every holder maps ``block`` at ``seq``'s logical index and expects the same tags in all of it (they matched
        exactly the content ``seq`` writes), and no other holder has read it yet (each gained it in this scheduling
        round: ``shares_scheduled_blocks``), unless the allocator declares ``recomputes_in_place``."""
        h = self.state
        mine = [index for holder, index in holders if holder == seq]
        if len(mine) != 1:
            return False
        layout = h.layout(seq)
        lo, hi = layout.first_position(mine[0]), layout.first_position(mine[0] + 1)
        tags = h.reference.tags(seq)
        if not all(index == mine[0] and h.reference.tags(holder)[lo:hi] == tags[lo:hi] for holder, index in holders):
            return False
        if h.caps.recomputes_in_place:
            return True
        step = self.pools.next_step
        return all(h.seqs[holder].joined_step == step for holder, _ in holders if holder != seq)

    def copy_deduplicated(self, seq: str, copy: BlockCopy, old_table: tuple[int, ...], old_len: int) -> int:
        """Invariant 5 for a grow's copy whose destination ``seq``'s table does not map after the grow: allowed only
        under ``dedupes_copied_tail``, as a copy of the partial tail block (logical block ``old_len // block_size``)
        that the grow filled, into a block no table references and the allocator does not list as cached (the
        table maps another block for it, whose content the caller checks). Returns that logical index."""
        h = self.state
        size = h.block_size
        index = old_len // size
        holders = h.refs.holders.get(copy.dst, set())
        cached = self.introspection is not None and copy.dst in self.introspection.cached_blocks()
        if not (old_len % size and index < len(old_table) and old_table[index] == copy.src):
            found = (
                f"block {copy.src} is not {seq}'s partial tail before the grow (table {list(old_table)}, "
                f"{old_len} tokens)"
            )
        elif h.length(seq) < (index + 1) * size:
            found = f"the grow leaves {seq}'s logical block {index} partial ({h.length(seq)} tokens)"
        elif holders:
            found = f"block {copy.dst} is referenced by {h.entries(holders)}"
        elif cached:
            found = f"block {copy.dst} is listed as cached: the copy overwrites cached K/V"
        else:
            return index
        self.fail(
            Invariant.EXCLUSIVE_WRITES,
            f"copy-on-write copy from block {copy.src} into block {copy.dst}, which {seq}'s table does not map after "
            "the grow",
            [
                f"expected: block {copy.dst} referenced by {seq} alone, or (dedupes_copied_tail) a copy of the partial "
                "tail the grow filled, into a block left unreferenced and uncached",
                f"found:    {found}; table after the grow {list(h.seqs[seq].table)}",
                *self.pools.block_story(copy.dst),
            ],
        )

    def lookahead_exclusive(self, seq: str, hit_tokens: int = 0) -> None:
        """Every block of ``seq``'s table that is a look-ahead entry (beyond the blocks its tokens fill), of ``seq`` or
        of another sequence holding it, is referenced by that entry alone: a look-ahead block receives its owner's
        drafts next (invariant 5), and is never served to a cache hit (invariant 9: ``seq`` was just admitted with
        ``hit_tokens`` cached tokens)."""
        h = self.state
        hit_blocks = h.layout(seq).blocks_for(hit_tokens)
        for index, block in enumerate(h.seqs[seq].table):
            holders = h.refs.holders.get(block, set())
            if len(holders) < 2:
                continue
            ahead = sorted((other, i) for other, i in holders if i >= h.num_blocks_for(other))
            if not ahead:
                continue
            owner, owner_index = ahead[0]
            matched = index < hit_blocks and owner != seq
            self.fail(
                Invariant.CACHE_SOUNDNESS if matched else Invariant.EXCLUSIVE_WRITES,
                f"cache hit of {hit_tokens} tokens for {seq} matched look-ahead block {block} of {owner}"
                if matched
                else f"look-ahead block {block} of {owner} (its logical block {owner_index}, beyond its "
                f"{h.length(owner)} token(s)) is shared",
                [
                    f"expected: block {block} referenced by {owner} alone: a look-ahead block holds none of its "
                    "tokens, is never shared by a fork nor served to a cache hit",
                    f"found:    referenced by {sorted(holders)}",
                    *self.pools.block_story(block),
                ],
            )
