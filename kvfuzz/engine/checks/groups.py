"""The checks that only several KV-cache groups need (``Capabilities.kv_groups``): every group's table read back
well formed, a physical block in one group's tables at a time, and the hybrid prefix-hit rule (its window, and a hit
that ends on a block boundary of every group).

Everything else a group table must keep (content, attention over its window, refcounts, the free set, exclusive
writes, cache soundness) is checked by the other checkers of :mod:`kvfuzz.engine.checks` on the group table itself,
which the expected state keeps as a sequence of its own (``group_seq``).
"""

from __future__ import annotations

import collections.abc
import math
from typing import Iterable, cast

from kvfuzz.allocator.protocol import GroupedTables
from kvfuzz.allocator.types import NULL_BLOCK, SeqId
from kvfuzz.engine.checks.context import CheckContext, Checker
from kvfuzz.engine.checks.results import ResultChecks
from kvfuzz.engine.violations import Invariant


class GroupChecks(Checker):
    """Checks of the groups' tables, raised through the shared context (same operation label)."""

    def __init__(self, context: CheckContext, results: ResultChecks) -> None:
        super().__init__(context)
        self.results = results  # invariant 12, for each group's table
        self.grouped = cast(GroupedTables, context.allocator)  # the allocator's group tables

    def tables(self, seq: SeqId, group0: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Invariant 12: ``group_block_tables(seq)`` returned one sequence of int block ids per group, group 0's
        equal to ``block_table(seq)`` (``group0``); returns the tables of groups 1 onwards."""
        groups = self.state.caps.kv_groups
        found = self.grouped.group_block_tables(seq)
        names = [group.name for group in groups]
        if not isinstance(found, collections.abc.Sequence) or len(found) != len(groups):
            self.fail(
                Invariant.RESULTS,
                f"group_block_tables({seq!r}) returned {found!r}",
                [f"expected: one block table per group, {len(groups)} in the order {names}"],
            )
        tables = [self.results.block_table(f"{seq} (group {name})", table) for name, table in zip(names, found)]
        if tables[0] != group0:
            self.fail(
                Invariant.RESULTS,
                f"group_block_tables({seq!r}) gives group {names[0]} a table unlike block_table({seq!r})",
                [f"expected: {list(group0)} (group 0's table is the block table)", f"found:    {list(tables[0])}"],
            )
        return tables[1:]

    def one_group(self, touched: Iterable[int]) -> None:
        """Invariant 3 under groups: each touched block is mapped by the tables of one group at most (sequences may
        share it within that group, never across groups: the groups are different layers)."""
        h = self.state
        for block in touched:
            holders = h.refs.holders.get(block, ())
            groups = {h.seqs[holder].group for holder, _ in holders}
            if len(groups) > 1:
                self.fail(
                    Invariant.REFCOUNTS,
                    f"block {block} is mapped by the tables of {len(groups)} KV-cache groups at once",
                    [
                        "expected: a physical block in one group's tables at a time (each group is other layers, "
                        "with K/V of its own)",
                        f"found:    {h.entries(holders)}",
                        *self.pools.block_story(block),
                    ],
                )

    def hit_window(self, seq: SeqId, num_cached: int) -> None:
        """Invariant 9, the hybrid rule: a hit of n tokens needs a sliding-window group's blocks covering positions
        [n - w + 1, n), the ones the next token (position n) reads besides its own; only blocks wholly before them
        may be dropped (NULL_BLOCK)."""
        h = self.state
        window = h.window(seq)
        if window is None or not num_cached:
            return
        layout, table = h.layout(seq), h.seqs[seq].table
        first = max(0, num_cached - window + 1)
        for index in range(layout.index(first), layout.blocks_for(num_cached)):
            if table[index] == NULL_BLOCK:
                self.fail(
                    Invariant.CACHE_SOUNDNESS,
                    f"cache hit of {num_cached} tokens for {h.label(seq)} leaves logical block {index} dropped, "
                    f"inside the window the next token reads",
                    [
                        f"expected: blocks holding positions {first}..{num_cached - 1} (sliding window {window}): a "
                        "hit of n tokens is valid only where every group holds what its attention reads at n",
                        f"found:    table {list(table)}",
                    ],
                )

    def hit_aligned(self, seq: SeqId, num_cached: int) -> None:
        """Invariant 9, the hybrid rule: a hit of n tokens ends on a block boundary of every group (n a multiple of
        each group's block size, so of their lcm: vLLM's ``scheduler_block_size``), unless it is the whole prompt of
        an engine that recomputes its last token. A hit ending inside a group's block leaves the rest of that block,
        which the hit took from the cache, to the next step's writes."""
        h = self.state
        if h.caps.recomputes_last_token and num_cached == h.length(seq):
            return
        sizes = [layout.size for layout in h.layouts]
        unaligned = [(group, size) for group, size in zip(h.caps.kv_groups, sizes) if num_cached % size]
        if unaligned:
            group, size = unaligned[0]
            self.fail(
                Invariant.CACHE_SOUNDNESS,
                f"cache hit of {num_cached} tokens for sequence {seq} ends inside a block of group {group.name} "
                f"({size} tokens per block)",
                [
                    f"expected: a hit that is a multiple of {math.lcm(*sizes)} tokens (every group's block size: "
                    f"{', '.join(f'{g.name} {s}' for g, s in zip(h.caps.kv_groups, sizes))}), so that each group's hit "
                    "covers whole blocks",
                    f"found:    {num_cached} cached tokens, ending at offset {num_cached % size} of group "
                    f"{group.name}'s logical block {num_cached // size}: that block would hold the hit's K/V before "
                    "the offset and the next step's writes after it",
                ],
            )
