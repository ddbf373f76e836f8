"""Invariant 5, exclusive writes: a block the engine writes (a scheduled token, a copy, a load) is referenced by
its writer alone."""

from __future__ import annotations

from kvfuzz.engine.checks.context import Checker
from kvfuzz.engine.violations import Cause, Invariant


class ExclusiveWrites(Checker):
    """Invariant 5: no write lands in a block another table entry references (unless it writes the same K/V under a
    declared policy)."""

    def block(self, block: int, seq: str, what: str) -> None:
        holders = self.state.refs.holders.get(block, set())
        if len(holders) == 1 and next(iter(holders))[0] == seq:  # the writer's alone: the common case, passed
            return
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
                Cause(f"{_kind_of_write(what)} into a block another table entry references"),
            )

    def _same_content(self, block: int, seq: str, holders: set) -> bool:
        """Every holder maps ``block`` at ``seq``'s logical index and expects the same tags in all of it (they matched
        exactly the content ``seq`` writes), and no other holder has read it yet (each gained it in this scheduling
        round: ``shares_scheduled_blocks``), unless the allocator declares ``recomputes_in_place``; or, under
        ``recomputes_in_place``, the block already holds in every slot the K/V ``seq`` writes there (another holder
        rolled back past the block's end keeps a stale tail that is still this prefix's K/V)."""
        h = self.state
        mine = [index for holder, index in holders if holder == seq]
        if len(mine) != 1:
            return False
        layout = h.layout(seq)
        lo, hi = layout.first_position(mine[0]), layout.first_position(mine[0] + 1)
        tags = h.reference.tags(seq)
        if h.caps.recomputes_in_place and hi <= len(tags) and self.pools.block_tags(block) == tuple(tags[lo:hi]):
            return True  # the block already holds every slot of what seq rewrites: the write changes nothing
        if not all(index == mine[0] and h.reference.tags(holder)[lo:hi] == tags[lo:hi] for holder, index in holders):
            return False
        if h.caps.recomputes_in_place:
            return True
        step = self.pools.next_step
        return all(h.seqs[holder].joined_step == step for holder, _ in holders if holder != seq)


def _kind_of_write(what: str) -> str:
    """The kind of write ``what`` describes (``"step 3 writes s0 position 4"``: a step's write), without the
    blocks, sequences and steps it names."""
    if "host-tier load" in what:
        return "a host-tier load"
    if "copy" in what:
        return "a " + what.partition(" from")[0].partition(" copy")[0] + " copy"
    if "schedules writes" in what:
        return "writes scheduled by " + what.partition(" schedules")[0].partition("(")[0]
    return "a step's write"
