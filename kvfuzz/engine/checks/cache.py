"""Invariant 9, cache soundness: a cache hit covers only K/V its prefix wrote, by a completed step (or one sure to
run), in blocks no eviction dropped; host-tier loads fill only the hit. (That look-ahead blocks are never cached is
:mod:`kvfuzz.engine.features.lookahead`'s own check.)"""

from __future__ import annotations

from typing import Collection, Optional, Sequence

from kvfuzz.allocator.types import (
    NULL_BLOCK,
)
from kvfuzz.engine.checks.context import CheckContext, Checker
from kvfuzz.engine.checks.eviction_order import CacheSnapshot
from kvfuzz.engine.checks.exclusive import ExclusiveWrites
from kvfuzz.engine.checks.explain import block_content, found, prefix, root_cause, shown_content, where, why_alike
from kvfuzz.engine.checks.results import is_int, shown
from kvfuzz.engine.pools import SlotWrite
from kvfuzz.engine.violations import Cause, Invariant

UNWRITTEN = Cause("a cache hit on K/V no completed step has written")
OTHER_PREFIX = Cause("a cache hit on a block that holds, or is about to hold, another prefix's K/V")
STALE_ENTRY = Cause("a cache hit through an entry that outlived its block's release to the free set")
"""A hit on a block the allocator listed free, or on K/V a block held when it was listed free before any write landed
there since: the cache kept an entry it should have dropped, whichever way the damage shows next (the block
handed out again, listed free while held, rewritten by its new holder)."""
WITHDRAWN = Cause("a cache hit on scheduled writes that were then withdrawn")
"""Also the cause of a block the cache still offers once writes scheduled into it were withdrawn, which a replay's
audit finds (:mod:`~kvfuzz.engine.checks.divergence`): the same wrong change, whether or not a hit already relies on
it."""


class CacheSoundness(Checker):
    """Invariant 9 on admissions' hits, withdrawn writes and host-tier loads."""

    def __init__(self, context: CheckContext, exclusive: ExclusiveWrites) -> None:
        super().__init__(context)
        self.exclusive = exclusive  # invariant 5, for the blocks a host-tier load writes

    def withdrawn_writes_unread(self, seq: str, why: str) -> None:
        """Invariant 9: withdrawing ``seq``'s scheduled writes (``why``: a preemption, or an abort whose engine does not
        declare ``free_lands_scheduled_writes``) leaves no other sequence holding a cache hit on them; a hit on
        scheduled writes is sound only while the step that writes them is sure to run. A slot a step has already
        written with the holder's K/V (a rewrite in place, ``recomputes_in_place``) loses nothing."""
        h = self.state
        mine = h.layout(seq)
        for position, slot in h.scheduled_writes(seq):
            block = mine.block_of(slot)
            record = self.pools.record(slot)
            for holder, index in sorted(h.refs.holders.get(block, ())):
                relies = h.layout(holder).first_position(index) + mine.offset_of(slot)
                if holder == seq or index != mine.index(position) or h.seqs[holder].written <= relies:
                    continue
                if record is not None and record.tag == h.reference.tags(holder)[relies]:
                    continue  # a step already wrote it: the withdrawn write would only rewrite it (in place)
                self.fail(
                    Invariant.CACHE_SOUNDNESS,
                    f"{why} withdraws {seq}'s scheduled write of position {position} into block {block}, which "
                    f"{holder}'s cache hit covers",
                    [
                        f"{holder} holds block {block} as its logical block {index} and counts position "
                        f"{relies} as computed: its admission hit K/V that {seq}'s next step was to write",
                        f"expected: a hit only on K/V a step is sure to write (an engine whose {why.split('(')[0]} "
                        "withdraws scheduled writes must not let another request hit them; vLLM lands an "
                        "aborted request's scheduled step: free_lands_scheduled_writes)",
                        f"found:    {holder} would read K/V at position {relies} that no step writes",
                        *self.pools.block_story(block),
                    ],
                    WITHDRAWN,
                )

    def free_before(self, snapshot: Optional[CacheSnapshot]) -> frozenset[int]:
        """The allocator's free set before an admission that may hit the cache (empty when it cannot show it, or
        declares no prefix cache): what :meth:`hit_on_released` compares the hit with; read from the eviction-order
        ``snapshot`` taken just before, where there is one, rather than asked for again."""
        alloc = self.introspection
        if alloc is None or not self.state.caps.prefix_cache:
            return frozenset()
        return snapshot.free if snapshot is not None else frozenset(alloc.free_blocks())

    def hit_on_released(
        self, seq: str, table: tuple[int, ...], num_cached: int, free_before: frozenset[int], loaded: Collection[int]
    ) -> None:
        """Invariant 9: a hit covers no block the allocator listed free before the admission, and no K/V a block held
        when it was listed free that nothing wrote there since (a free block is in no cache: its entries go with
        it); a block a host-tier load refills (``loaded``) is exempt. Checked before the table's shape, the pool's
        accounting and the content, which see this bug's consequences (the block handed out again, listed free while
        held, holding its new holder's K/V)."""
        h = self.state
        layout = h.layout(seq)
        tags = h.reference.tags(seq)
        freed = self.pools.freed_tags
        for index, block in enumerate(table[: layout.blocks_for(num_cached)]):
            if block in loaded:  # a host-tier load refills it: what it held is not read
                continue
            if block in free_before:
                why = "which the allocator listed as free before this admission"
                found = f"block {block} in the free set, its cache entry still matching"
            else:
                first = layout.first_position(index)
                held = [
                    position
                    for position in range(first, min(first + layout.size, num_cached))
                    if tags[position] in freed.get(block * self.pools.block_size + position - first, ())
                ]
                if not held or layout.size != self.pools.block_size:
                    continue
                why = (
                    f"whose K/V at positions {held[0]}..{held[-1]} it held when the allocator listed it free, and "
                    "nothing has written there since"
                )
                found = f"block {block} matched through an entry its release to the free set should have dropped"
            cause = STALE_ENTRY
            withdrawn = self.pools.withdrawn.get(block)
            if withdrawn is not None:  # the entry names K/V a withdrawal kept from it: that is the wrong change
                found += f", though {withdrawn} withdrew the writes that were to fill it"
                cause = WITHDRAWN if h.caps.hits_scheduled_writes else UNWRITTEN
            self.fail(
                Invariant.CACHE_SOUNDNESS,
                f"cache hit of {num_cached} tokens for {seq} covers logical block {index} (block {block}), {why}",
                [
                    "expected: a hit only on cached blocks (a block released to the free set leaves the cache: "
                    "its entries go with it)",
                    f"found:    {found}",
                    *self.pools.block_story(block),
                ],
                cause,
            )

    def hit_on_evicted(self, seq: str, num_cached: int, table: tuple[int, ...], evicted: dict[int, str]) -> None:
        """Invariant 9: a hit covers no block an eviction dropped from the cache and no table has mapped since,
        whatever K/V the block still holds. ``evicted`` maps such a block's logical index in ``table`` to the
        eviction."""
        first_position = self.state.layout(seq).first_position
        for index, eviction in sorted(evicted.items()):
            if first_position(index) < num_cached:
                self.fail(
                    Invariant.CACHE_SOUNDNESS,
                    f"cache hit of {num_cached} tokens for {seq} covers logical block {index} (block {table[index]}), "
                    "which an eviction dropped from the cache",
                    [
                        f"expected: a hit that stops before logical block {index} (position {first_position(index)}): "
                        "the "
                        f"block was evicted by {eviction}, and no table has mapped it since",
                        f"found:    {num_cached} cached tokens, running on past it",
                        *self.pools.block_story(table[index]),
                    ],
                    Cause("a cache hit covering a block an eviction dropped"),
                )

    def cache_hit(self, seq: str, num_cached: int, loading: Collection[int] = ()) -> bool:
        """Invariant 9 for an admission's reported hit; returns whether it covers K/V only the next step writes.

        ``loading``: device blocks a host-tier load fills when the next step is launched (``host_cache``); a hit on
        them awaits that step, and their content is checked when the load lands."""
        h = self.state
        length = len(h.reference.tokens(seq))
        if num_cached > length:
            self.fail(
                Invariant.CACHE_SOUNDNESS,
                f"admit of {seq} reports {num_cached} cached tokens",
                [f"expected: at most the prompt's {length} tokens"],
                Cause("a cache hit longer than the prompt"),
            )
        if num_cached and not h.caps.prefix_cache:
            self.fail(
                Invariant.CACHE_SOUNDNESS,
                f"admit of {seq} reports {num_cached} cached tokens",
                ["expected: 0: the allocator does not declare a prefix cache"],
                Cause("a cache hit from an allocator that declares no prefix cache"),
            )
        if num_cached and num_cached == length and not h.caps.recomputes_last_token:
            self.fail(
                Invariant.CACHE_SOUNDNESS,
                f"admit of {seq} reports a cache hit of its whole prompt ({length} tokens)",
                [
                    f"expected: at most {length - 1} cached tokens: the engine needs at least one query token to "
                    "sample the next token from, and a request prefilled with none is handed another request's "
                    "logits (an allocator whose engine recomputes the last token itself declares "
                    "recomputes_last_token)",
                    f"found:    all {length} positions reported cached, up to {where(self.state, seq, length - 1)}",
                ],
                Cause("a cache hit covering the whole prompt"),
            )
        layout = h.layout(seq)
        table = h.seqs[seq].table
        awaits_step = False
        scheduled: Optional[dict[int, int]] = None  # the next step's writes, gathered once if a hit needs them
        for position in range(num_cached):
            if table[layout.index(position)] == NULL_BLOCK:
                continue
            slot = layout.slot_of(table, position)
            if layout.block_of(slot) in loading:
                awaits_step = True  # a host-tier load fills it before the next step reads it
                continue
            record = self.pools.record(slot)
            tag = h.reference.tags(seq)[position]
            if h.caps.hits_scheduled_writes and record is not None and record.tag == tag:
                continue  # written by a launched step
            if h.caps.hits_scheduled_writes:
                scheduled = h.scheduled_tags() if scheduled is None else scheduled
                if scheduled.get(slot) == tag:
                    awaits_step = True  # written by the next step, before anything reads it
                    continue
            if record is None or record.tag != tag or record.step > self.pools.last_completed:
                why, lines, cause = self._unsound_hit(seq, position, slot, record, tag)
                self.fail(
                    Invariant.CACHE_SOUNDNESS,
                    f"cache hit of {num_cached} tokens for {h.label(seq) if h.caps.kv_groups else seq} covers "
                    f"position {position}, but {why}",
                    [
                        where(self.state, seq, position),
                        f"expected: K/V of {prefix(self.state, seq, position)}, written "
                        + (
                            "by a step, or scheduled by a live sequence for the next one"
                            if h.caps.hits_scheduled_writes
                            else "by a completed step"
                        ),
                        f"found:    {found(record)}",
                        *lines,
                        *self.pools.block_story(layout.block_of(slot)),
                    ],
                    cause,
                )
        return awaits_step

    def _unsound_hit(
        self, seq: str, position: int, slot: int, record: Optional[SlotWrite], tag: int
    ) -> tuple[str, list[str], Cause]:
        """Why a hit may not cover ``slot``, for the summary, the root-cause lines (what the slot holds, or which
        scheduled write will fill it) and the cause: K/V no completed step wrote, or another prefix's."""
        h = self.state
        writer = h.scheduled_writer(slot) if record is None or record.tag != tag else None
        next_step = self.pools.next_step
        if writer is not None and h.reference.tags(writer[0])[writer[1]] == tag:
            return (
                f"nothing is written there yet: {writer[0]} writes it at the next step (step {next_step})",
                [
                    f"root cause: the block became matchable when {writer[0]}'s write was scheduled, not when a step "
                    "had written it; only an allocator that declares hits_scheduled_writes may count K/V a step "
                    "has yet to write as cached"
                ],
                UNWRITTEN,
            )
        if writer is not None:
            theirs = block_content(self.state, writer[0], h.layout(writer[0]).index(writer[1]))
            index = h.layout(seq).index(position)
            mine = block_content(self.state, seq, index)
            alike = why_alike(mine, theirs, h.layout(seq).first_position(index))
            return (
                f"another prefix's scheduled write will fill it: {writer[0]} position {writer[1]} writes there at "
                f"the next step (step {next_step})",
                [
                    f"root cause: the hit matched a block that {writer[0]} is about to fill with other K/V:",
                    f"  {seq} expects {shown_content(mine)}",
                    f"  {writer[0]} writes {shown_content(theirs)}",
                    f"  {alike}, or the block's cache entry outlived a change to "
                    f"{writer[0]}'s tokens (a rollback, see the block's history)",
                ],
                OTHER_PREFIX,
            )
        if record is None:
            summary = "nothing has been written there, and no live sequence is scheduled to write it"
            if not h.caps.hits_scheduled_writes:
                return summary, [], UNWRITTEN
            return (
                summary,
                [
                    "root cause: the allocator matches scheduled writes (hits_scheduled_writes), and no step or "
                    "scheduled write fills this slot: the block stayed matchable after a preemption or abort "
                    "withdrew the write it was matched for (see the block's history), where a release that "
                    "withdraws scheduled writes must drop their cache entries, or it was made matchable with no "
                    "write scheduled"
                ],
                UNWRITTEN,
            )
        if record.tag != tag:
            lines = [*self._hit_from_another_group(seq, position, slot), *root_cause(h, seq, position, slot, record)]
            return "it holds another prefix's K/V", lines, OTHER_PREFIX
        completed = self.pools.last_completed
        return f"the step that put it there has not completed (last completed: {completed})", [], UNWRITTEN

    def _hit_from_another_group(self, seq: str, position: int, slot: int) -> list[str]:
        """Under ``kv_groups``, for a group table (``seq``, not group 0's) whose hit covers ``position`` in a block
        holding another prefix's K/V: when the request's group 0 block holds its own K/V there, the root cause that
        the hit was taken from group 0's cache alone (else nothing)."""
        h = self.state
        model = h.seqs[seq]
        if not model.owner or model.group == 0 or model.owner not in h.seqs:
            return []
        owner = model.owner
        table = h.seqs[owner].table
        layout = h.layout(owner)
        if layout.index(position) >= len(table) or table[layout.index(position)] == NULL_BLOCK:
            return []
        theirs = layout.slot_of(table, position)
        record = self.pools.record(theirs)
        if record is None or record.tag != h.reference.tags(owner)[position]:
            return []
        groups = h.caps.kv_groups
        return [
            f"root cause: {owner}'s group {groups[0].name} block for position {position} (block "
            f"{layout.block_of(theirs)}) holds its K/V, group {groups[model.group].name}'s (block "
            f"{h.layout(seq).block_of(slot)}) does not: the hit was taken from group {groups[0].name}'s cache alone, "
            "and where this group's block of those positions was one the window dropped, or one which an eviction "
            "dropped from the cache, a fresh block was mapped in its place and reported cached"
        ]

    def loads_into_the_hit(
        self, seq: str, table: tuple[int, ...], loads: Sequence[tuple[int, int]], num_cached: int
    ) -> None:
        """Invariant 9 for an admission's host-tier loads, before anything reads its table (a load into a block
        outside the hit leaves a hit block unfilled, which the checks after it would see as a stale cache entry):
        only under ``host_cache``, from host blocks that exist, each into a block of the sequence's cache hit."""
        h = self.state
        hit_blocks = [block for block in table[: h.layout(seq).blocks_for(num_cached)] if block != NULL_BLOCK]
        if not h.caps.host_cache:
            self.fail(
                Invariant.CACHE_SOUNDNESS,
                f"admit of {seq} orders host-tier loads {list(loads)}",
                ["expected: none: the allocator does not declare host_cache"],
                Cause("host-tier loads from an allocator that declares no host_cache"),
            )
        for host_block, block in loads:
            if not (is_int(host_block) and 0 <= host_block < h.num_host_blocks) or block not in hit_blocks:
                self.fail(
                    Invariant.CACHE_SOUNDNESS,
                    f"admit of {seq} loads host block {shown(host_block)} into block {shown(block)}",
                    [
                        f"expected: a host block 0 .. {h.num_host_blocks - 1} loaded into one of the blocks its "
                        f"{num_cached}-token hit covers, {hit_blocks}",
                        *(self.pools.block_story(block) if is_int(block) and block >= 0 else ()),
                    ],
                    Cause("a host-tier load from no host block, or into a block outside the hit"),
                )

    def host_loads(self, seq: str, loads: Sequence[tuple[int, int]]) -> None:
        """Invariant 5 for an admission's host-tier loads (:meth:`loads_into_the_hit` checked where they go): each
        into a distinct block of the hit that it alone references."""
        for host_block, block in loads:
            self.exclusive.block(block, seq, f"host-tier load for {seq} from host block {host_block}")
        destinations = [block for _, block in loads]
        if len(set(destinations)) != len(destinations):
            self.fail(
                Invariant.CACHE_SOUNDNESS,
                f"admit of {seq} loads two host blocks into one device block: {list(loads)}",
                ["expected: each device block loaded once"],
                Cause("two host-tier loads into one device block"),
            )
