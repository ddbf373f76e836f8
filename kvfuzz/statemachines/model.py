"""What kvfuzz expects of the allocator's state: each sequence's lifecycle and block table, and who references
every block.

``BlockRefs`` keeps, for every block, the set of (sequence, logical index) entries of running sequences that map
to it; the expected refcount of a block is the size of that set, and a block with no holders is unreferenced.
Dropped entries (NULL_BLOCK) reference nothing.
"""

from __future__ import annotations

import enum
from typing import Iterable

import attrs

from kvfuzz.allocator.types import NULL_BLOCK, SeqId


def mapped(table: Iterable[int]) -> list[int]:
    """The physical blocks a table maps, in order, without its dropped (NULL_BLOCK) entries."""
    return [block for block in table if block != NULL_BLOCK]


class Status(enum.Enum):
    RUNNING = "running"
    SWAPPED = "swapped out"
    PREEMPTED = "preempted"


@attrs.define
class SeqModel:
    """One sequence the engine knows. Positions below ``written`` hold K/V; the rest are written at the next step.

    ``table`` is the device block table while running (NULL_BLOCK where a sliding window dropped a block);
    ``host_table`` the host blocks while swapped out. ``awaits_step`` marks a cache hit on K/V another sequence
    writes only at the next step (``matchable_when_scheduled``): until that step the sequence is not computed.
    ``joined_step`` is the step before which it last gained its blocks (admission, fork, swap-in): no step before
    that one has read them for it.
    """

    seq: SeqId
    status: Status
    table: tuple[int, ...] = ()
    host_table: tuple[int, ...] = ()
    written: int = 0
    awaits_step: bool = False
    joined_step: int = 0


@attrs.frozen
class TableChange:
    """What one table update did to the blocks: every block whose holders changed, and which became (un)referenced."""

    touched: frozenset[int]
    released: tuple[int, ...]
    acquired: tuple[int, ...]


class BlockRefs:
    """Holders of every referenced block."""

    def __init__(self) -> None:
        self.holders: dict[int, set[tuple[SeqId, int]]] = {}

    def refcount(self, block: int) -> int:
        return len(self.holders.get(block, ()))

    def num_referenced(self) -> int:
        return len(self.holders)

    def replace(self, seq: SeqId, old: tuple[int, ...], new: tuple[int, ...]) -> TableChange:
        """``seq``'s table went from ``old`` to ``new``."""
        touched, released, acquired = set(), [], []
        for index in range(max(len(old), len(new))):
            before = old[index] if index < len(old) and old[index] != NULL_BLOCK else None
            after = new[index] if index < len(new) and new[index] != NULL_BLOCK else None
            if before == after:
                continue
            if before is not None:
                holders = self.holders[before]
                holders.discard((seq, index))
                touched.add(before)
                if not holders:
                    del self.holders[before]
                    released.append(before)
            if after is not None:
                holders = self.holders.setdefault(after, set())
                if not holders:
                    acquired.append(after)
                holders.add((seq, index))
                touched.add(after)
        released = [block for block in released if block not in self.holders]
        return TableChange(frozenset(touched), tuple(reversed(released)), tuple(acquired))

    def holders_of(self, blocks: Iterable[int]) -> dict[int, set[tuple[SeqId, int]]]:
        return {block: self.holders.get(block, set()) for block in blocks}
