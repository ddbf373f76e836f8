"""Speculative decoding's look-ahead blocks (``lookahead_blocks``): the entries of a table beyond the blocks its
tokens fill, noted in their histories, held to their owner alone (invariant 5) and never cached once released
(invariant 9). Both checks are the feature's own (only a look-ahead entry triggers them), and so is the state they
need, the blocks released as look-ahead entries. The drafts a rollback may drop (``speculative_tokens``) are the
expected state's.
"""

from __future__ import annotations

from kvfuzz.engine.checks import CheckContext
from kvfuzz.engine.core import EngineCore
from kvfuzz.engine.events import Completion, TableSet
from kvfuzz.engine.violations import Cause, Invariant


class LookAhead:
    """Under ``lookahead_blocks``: the blocks released as look-ahead entries, kept and checked after every table
    update and step completion."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core  # the engine this feature is part of
        # Blocks released as look-ahead entries and neither referenced again nor seen free since: never cached.
        self.released: set[int] = set()

    def table_set(self, record: TableSet) -> None:
        """Note the look-ahead entries a table keeps, remember those it released, and check both rules."""
        core, seq, table = self.core, record.seq, record.table
        state, pools = core.expected, core.pools
        held = core.blocks(state.length(seq) if record.held_tokens is None else record.held_tokens, seq)
        for index in range(core.blocks(state.length(seq), seq) if table else held, min(held, len(table))):
            pools.note(table[index], f"kept as look-ahead by {seq} (logical block {index})")
        self.released |= {block for block in record.old[held:] if block in record.change.released}
        self.released -= set(record.change.acquired)
        if table:
            check_exclusive(core.checks.context, seq, record.hit_tokens)
        check_not_cached(core.checks.context, self.released)

    def completed(self, completion: Completion) -> None:
        """A completion may have settled a released look-ahead block: still not cached."""
        check_not_cached(self.core.checks.context, self.released)


def check_exclusive(context: CheckContext, seq: str, hit_tokens: int = 0) -> None:
    """Every block of ``seq``'s table that is a look-ahead entry (beyond the blocks its tokens fill), of ``seq`` or
    of another sequence holding it, is referenced by that entry alone: a look-ahead block receives its owner's
    drafts next (invariant 5), and is never served to a cache hit (invariant 9: ``seq`` was just admitted with
    ``hit_tokens`` cached tokens)."""
    h = context.state
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
        context.fail(
            Invariant.CACHE_SOUNDNESS if matched else Invariant.EXCLUSIVE_WRITES,
            f"cache hit of {hit_tokens} tokens for {seq} matched look-ahead block {block} of {owner}"
            if matched
            else f"look-ahead block {block} of {owner} (its logical block {owner_index}, beyond its "
            f"{h.length(owner)} token(s)) is shared",
            [
                f"expected: block {block} referenced by {owner} alone: a look-ahead block holds none of its "
                "tokens, is never shared by a fork nor served to a cache hit",
                f"found:    referenced by {sorted(holders)}",
                *context.pools.block_story(block),
            ],
            Cause("a cache hit on another sequence's look-ahead block" if matched else "a shared look-ahead block"),
        )


def check_not_cached(context: CheckContext, released: set[int]) -> None:
    """Invariant 9: a block released as a look-ahead entry holds no K/V of any prefix, so the allocator never lists it
    as cached (reusable) content; checked until it is referenced again or free (and then dropped from ``released``)."""
    alloc = context.introspection
    if alloc is None or not released:
        return
    cached, free = alloc.cached_blocks(), alloc.free_blocks()
    for block in sorted(released):
        if block in cached:
            context.fail(
                Invariant.CACHE_SOUNDNESS,
                f"block {block}, released as a look-ahead block, is listed as cached",
                [
                    "expected: free (or pending): a look-ahead block holds no tokens of its sequence, so no "
                    "prefix may be matched to it",
                    "found:    in the cached (evictable) set",
                    *context.pools.block_story(block),
                ],
                Cause("a block released as a look-ahead block listed as cached"),
            )
        if block in free:
            released.discard(block)
