"""The prefix cache's declared policy of complete caching (``complete_caching``): every full block a completed step
wrote is owed matchable until an eviction or a reset drops it. The engine notes the blocks each step fills, owes them
once that step has surely completed, and has invariant 14 checked at admissions and releases: a block owed matchable
stays matchable (cached, pending or referenced), and an admission reports at least the hit the cache owes it. Those
checks are the feature's own (only complete caching triggers them); the debt itself is the expected state's
``matchable`` (:mod:`kvfuzz.engine.matchable`), which evictions, forks, swaps and rollbacks also settle.
"""

from __future__ import annotations

from typing import Sequence

from kvfuzz.allocator.types import NULL_BLOCK, SeqId
from kvfuzz.engine.checks import CheckContext
from kvfuzz.engine.checks.explain import open_window, prefix
from kvfuzz.engine.core import EngineCore
from kvfuzz.engine.events import Completion, TableSet
from kvfuzz.engine.expected import Status
from kvfuzz.engine.matchable import Filled
from kvfuzz.engine.violations import Cause, Invariant


class CachingDebt:
    """Under complete caching, where the allocator shows its sets and no sliding window drops blocks (the
    context's ``owes_caching``): what the cache owes."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core  # the engine this feature is part of

    def owed(self, tags: Sequence[int]) -> list[tuple[int, str]]:
        """What an admission of a prompt with these tags must report cached (before the allocator is called)."""
        return owed_hit(self.core.checks.context, tags)

    def table_set(self, record: TableSet) -> None:
        """A block owed matchable that a table released stays matchable."""
        for block in record.change.released:
            check_released_matchable(self.core.checks.context, block)

    def scheduling(self, step: int) -> None:
        """Step ``step`` is scheduled: the full blocks each running table's writes fill are noted."""
        for seq in self.core.expected.ids(Status.RUNNING, groups=True):
            self._note_filled(seq, step)

    def _note_filled(self, seq: SeqId, step: int) -> None:
        """The full blocks of ``seq`` that step ``step`` fills are owed matchable once the step its writes were
        scheduled for has surely completed (step c + W + 1, c the last completed now). A block that holds drafts of
        the latest grow is not: a rollback may still reject them, and an allocator caches only verified tokens
        (vLLM's ``allocate_slots`` caches up to ``request.num_tokens``, never a draft)."""
        core = self.core
        model, size = core.expected.seqs[seq], core.expected.layout(seq).size
        due = core.pools.last_completed + core.caps.inflight_window + 1
        tags = core.expected.reference.tags(seq)
        for index in range(model.written // size, (len(tags) - model.drafts) // size):
            block = model.table[index]
            if block != NULL_BLOCK:
                written = f"{seq} as its logical block {index} at step {step}"
                core.expected.matchable.fill(Filled(due, seq, index, block, tags[(index + 1) * size - 1], written))

    def completed(self, completion: Completion) -> None:
        """The blocks filled in time for this step's completion are owed matchable, if their writer still maps
        them."""
        state = self.core.expected
        for filled in state.matchable.due(completion.step):
            model = state.seqs.get(filled.seq)
            if (
                model is not None
                and model.status is Status.RUNNING
                and filled.index < len(model.table)
                and model.table[filled.index] == filled.block
                and model.written >= state.layout(filled.seq).first_position(filled.index + 1)
            ):
                state.matchable.owe(filled)


def _kept(context: CheckContext, tag: int) -> list[tuple[int, str]]:
    """The blocks owed matchable as prefix ``tag`` that the allocator keeps: referenced, cached or pending."""
    alloc = context.introspection
    assert alloc is not None
    holders = context.state.matchable.holders(tag)
    if not holders:
        return []
    cached, pending, referenced = alloc.cached_blocks(), alloc.pending_blocks(), context.state.refs.holders
    return [(b, w) for b, w in holders.items() if b in referenced or b in cached or b in pending]


def owed_hit(context: CheckContext, tags: Sequence[int]) -> list[tuple[int, str]]:
    """For a prompt with these position tags, one (block, who wrote it) per leading full block an admission
    must report cached: a block owed matchable holds its prefix (a block that went to the free set without an
    eviction is still owed). A hit never covers the whole prompt (the engine needs a query token), so its last
    token's block is never owed."""
    size = context.state.layouts[0].size  # a sequence's own table (group 0's)
    matchable = context.state.matchable
    owed: list[tuple[int, str]] = []
    for index in range((len(tags) - 1) // size):
        holders = matchable.holders(tags[(index + 1) * size - 1])
        if not holders:
            break
        owed.append(next(iter(holders.items())))
    return owed


def check_missed_hit(context: CheckContext, seq: str, num_cached: int, owed: Sequence[tuple[int, str]]) -> None:
    """Invariant 14: an admission reports at least the cached tokens the cache owes it."""
    size = context.state.layout(seq).size
    if num_cached >= len(owed) * size:
        return
    index = num_cached // size
    block, written = owed[index]
    why, cause = _why_missed(context, seq, block)
    context.fail(
        Invariant.COMPLETE_CACHING,
        f"admission of {seq} reports {num_cached} cached tokens, but its first {len(owed) * size} are matchable "
        "(a missed hit)",
        [
            f"logical block {index} (positions {index * size}..{(index + 1) * size - 1}, "
            f"{prefix(context.state, seq, (index + 1) * size - 1)}): block {block} holds its K/V, written by "
            f"{written}, and no eviction has dropped it",
            f"why:      {why}",
            f"expected: at least {len(owed) * size} cached tokens (complete caching; a hit never covers the "
            "whole prompt)",
            f"found:    {num_cached}",
            *context.pools.block_story(block),
        ],
        cause,
    )


def _why_missed(context: CheckContext, seq: str, block: int) -> tuple[str, Cause]:
    """Where the owed ``block`` is now, by what the expected state knows (the tables that map it, its in-flight
    window) and the allocator's sets: the true cause of a missed hit, in the words of this block and as the cause
    that makes it one finding."""
    alloc = context.introspection
    assert alloc is not None
    window = open_window(context.pools, block)
    holders = sorted(context.state.refs.holders.get(block, ()))
    mine = [index for holder, index in holders if holder == seq]
    if mine and window is not None:
        return (
            f"block {block} was handed out again inside its in-flight window: {seq} maps it as its logical block "
            f"{mine[0]} for new content, though it was {window}; the allocator took it from its in-flight window "
            "and dropped its cache entry"
        ), Cause("a missed hit: a block handed out again inside its in-flight window, its cache entry dropped")
    if mine:
        return (
            f"block {block} was handed out again to {seq} as its logical block {mine[0]} for new content: the "
            "allocator dropped its cache entry without evicting it"
        ), Cause("a missed hit: a block handed out again for new content without an eviction")
    if holders:
        return (
            f"block {block} is still mapped by {context.state.entries(holders)}, yet the cache did not match it: its "
            "prefix was never registered, or the lookup missed it"
        ), Cause("a missed hit: a prefix a live table still maps, never registered or missed by the lookup")
    if block in alloc.pending_blocks():
        return (
            f"block {block} is pending in its in-flight window, where it stays matchable, yet the cache did not "
            "match it: its prefix was never registered, or the lookup missed it"
        ), Cause("a missed hit: a pending block's prefix, never registered or missed by the lookup")
    if block in alloc.cached_blocks():
        return (
            f"block {block} is in the cached set, yet the cache did not match it: its prefix was never registered, "
            "or the lookup missed it"
        ), Cause("a missed hit: a cached block's prefix, never registered or missed by the lookup")
    if block in alloc.free_blocks():
        if window is not None:
            return (
                f"block {block} is in the free set inside its in-flight window (it was {window}): the allocator "
                "freed it early and dropped its cache entry"
            ), Cause("a missed hit: a block freed early inside its in-flight window, its cache entry dropped")
        return (  # a held block is in no set, so whether it was ever registered is not observable
            f"block {block} went to the free set without an eviction, unmatched: its prefix was never registered, "
            "or its cache entry was dropped when it was released"
        ), Cause("a missed hit: a block freed without an eviction, never registered or its entry dropped")
    return (
        f"block {block} is in none of the free, cached and pending sets, and no table maps it: it was leaked, "
        "and its cache entry with it"
    ), Cause("a missed hit: a block leaked with its cache entry")


def check_released_matchable(context: CheckContext, block: int) -> None:
    """Invariant 14: a block owed matchable that its last holder released stays matchable (it, or another block
    holding the same prefix, is cached or pending), rather than going to the free set or nowhere (a leak)."""
    tag = context.state.matchable.tag_of.get(block)
    if tag is None or _kept(context, tag):
        return
    alloc = context.introspection
    assert alloc is not None
    if block in alloc.free_blocks():
        went = "went to the free set"
        cause = Cause("a released block the cache owes went to the free set")
    else:
        references = alloc.refcount(block)
        went = "went to none of the free, cached and pending sets (leaked" + (
            f": the allocator still counts {references} reference(s) to it)" if references else ")"
        )
        cause = Cause("a released block the cache owes leaked, its cache entry with it")
    context.fail(
        Invariant.COMPLETE_CACHING,
        f"block {block} {went} when it was released, though the cache owes its prefix",
        [
            f"block {block} holds a full block written by {context.state.matchable.holders(tag)[block]}",
            "expected: it stays cached (matchable for its namespace and prefix) until it is evicted or the cache reset",
            "found:    no block holding that prefix is referenced, cached or pending",
            *context.pools.block_story(block),
        ],
        cause,
    )
