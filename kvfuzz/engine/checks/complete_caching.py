"""Invariant 14, complete caching (a declared policy): every full block a completed step wrote stays matchable
(cached, pending or referenced) until an eviction or a reset drops it, and an admission reports at least the hit
the cache owes it."""

from __future__ import annotations

from typing import Sequence

from kvfuzz.engine.checks.context import Checker
from kvfuzz.engine.checks.explain import open_window, prefix
from kvfuzz.engine.violations import Invariant


class CompleteCaching(Checker):
    """Invariant 14 against the expected state's matchable blocks (:mod:`kvfuzz.engine.matchable`)."""

    def _kept(self, tag: int) -> list[tuple[int, str]]:
        """The blocks owed matchable as prefix ``tag`` that the allocator keeps: referenced, cached or pending."""
        alloc = self.introspection
        assert alloc is not None
        holders = self.state.matchable.holders(tag)
        if not holders:
            return []
        cached, pending, referenced = alloc.cached_blocks(), alloc.pending_blocks(), self.state.refs.holders
        return [(b, w) for b, w in holders.items() if b in referenced or b in cached or b in pending]

    def owed_hit(self, tags: Sequence[int]) -> list[tuple[int, str]]:
        """For a prompt with these position tags, one (block, who wrote it) per leading full block an admission
        must report cached: a block owed matchable holds its prefix (a block that went to the free set without an
        eviction is still owed). A hit never covers the whole prompt (the engine needs a query token), so its last
        token's block is never owed."""
        size = self.state.layouts[0].size  # a sequence's own table (group 0's)
        matchable = self.state.matchable
        owed: list[tuple[int, str]] = []
        for index in range((len(tags) - 1) // size):
            holders = matchable.holders(tags[(index + 1) * size - 1])
            if not holders:
                break
            owed.append(next(iter(holders.items())))
        return owed

    def missed_hit(self, seq: str, num_cached: int, owed: Sequence[tuple[int, str]]) -> None:
        """Invariant 14: an admission reports at least the cached tokens the cache owes it."""
        size = self.state.layout(seq).size
        if num_cached >= len(owed) * size:
            return
        index = num_cached // size
        block, written = owed[index]
        self.fail(
            Invariant.COMPLETE_CACHING,
            f"admission of {seq} reports {num_cached} cached tokens, but its first {len(owed) * size} are matchable "
            "(a missed hit)",
            [
                f"logical block {index} (positions {index * size}..{(index + 1) * size - 1}, "
                f"{prefix(self.state, seq, (index + 1) * size - 1)}): block {block} holds its K/V, written by "
                f"{written}, and no eviction has dropped it",
                f"cause: {self._why_missed(seq, block)}",
                f"expected: at least {len(owed) * size} cached tokens (complete caching; a hit never covers the "
                "whole prompt)",
                f"found:    {num_cached}",
                *self.pools.block_story(block),
            ],
        )

    def _why_missed(self, seq: str, block: int) -> str:
        """Where the owed ``block`` is now, by what the expected state knows (the tables that map it, its in-flight
        window) and the allocator's sets: the true cause of a missed hit."""
        alloc = self.introspection
        assert alloc is not None
        window = open_window(self.pools, block)
        holders = sorted(self.state.refs.holders.get(block, ()))
        mine = [index for holder, index in holders if holder == seq]
        if mine and window is not None:
            return (
                f"block {block} was handed out again inside its in-flight window: {seq} maps it as its logical block "
                f"{mine[0]} for new content, though it was {window}; the allocator took it from its in-flight window "
                "and dropped its cache entry"
            )
        if mine:
            return (
                f"block {block} was handed out again to {seq} as its logical block {mine[0]} for new content: the "
                "allocator dropped its cache entry without evicting it"
            )
        if holders:
            return (
                f"block {block} is still mapped by {self.state.entries(holders)}, yet the cache did not match it: its "
                "prefix was never registered, or the lookup missed it"
            )
        if block in alloc.pending_blocks():
            return (
                f"block {block} is pending in its in-flight window, where it stays matchable, yet the cache did not "
                "match it: its prefix was never registered, or the lookup missed it"
            )
        if block in alloc.cached_blocks():
            return (
                f"block {block} is in the cached set, yet the cache did not match it: its prefix was never registered, "
                "or the lookup missed it"
            )
        if block in alloc.free_blocks():
            if window is not None:
                return (
                    f"block {block} is in the free set inside its in-flight window (it was {window}): the allocator "
                    "freed it early and dropped its cache entry"
                )
            return f"block {block} went to the free set without an eviction: its cache entry was dropped"
        return (
            f"block {block} is in none of the free, cached and pending sets, and no table maps it: it was leaked, "
            "and its cache entry with it"
        )

    def released_matchable(self, block: int) -> None:
        """Invariant 14: a block owed matchable that its last holder released stays matchable (it, or another block
        holding the same prefix, is cached or pending), rather than going to the free set or nowhere (a leak)."""
        tag = self.state.matchable.tag_of.get(block)
        if tag is None or self._kept(tag):
            return
        alloc = self.introspection
        assert alloc is not None
        if block in alloc.free_blocks():
            went = "went to the free set"
        else:
            references = alloc.refcount(block)
            went = "went to none of the free, cached and pending sets (leaked" + (
                f": the allocator still counts {references} reference(s) to it)" if references else ")"
            )
        self.fail(
            Invariant.COMPLETE_CACHING,
            f"block {block} {went} when it was released, though the cache owes its prefix",
            [
                f"block {block} holds a full block written by {self.state.matchable.holders(tag)[block]}",
                "expected: it stays cached (matchable for its namespace and prefix) until it is evicted or the cache "
                "reset",
                "found:    no block holding that prefix is referenced, cached or pending",
                *self.pools.block_story(block),
            ],
        )
