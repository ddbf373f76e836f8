"""Invariants 3 and 4, refcounts and the free set: every block's refcount is the number of table entries naming it,
and every unreferenced block is in exactly one of the free, cached and pending sets (device and host pools)."""

from __future__ import annotations

from typing import Collection, Iterable, Sequence

from kvfuzz.allocator.protocol import Introspectable
from kvfuzz.engine.checks.context import Checker
from kvfuzz.engine.violations import Cause, Invariant

OVER_COUNT = Cause("a refcount above the table entries naming the block: a reference never released")
UNDER_COUNT = Cause(
    "a refcount below the table entries naming the block: a reference released too often or never taken"
)


_WHOLE_TABLE = "a release of a sequence's whole device table (free, preempt or swap-out)"
_RELEASE_PATHS: dict[str, str] = {
    "free": _WHOLE_TABLE,
    "preempt": _WHOLE_TABLE,
    "swap_out": _WHOLE_TABLE,
    "swap_in": "a swap-in that mapped device blocks",
    "rollback": "a rollback, which drops blocks from the table (their references, released or not)",
    "grow": "a grow that changed the table (a new block, a copy-on-write, a block out of the window)",
    "decode": "a grow that changed the table (a new block, a copy-on-write, a block out of the window)",
    "fork": "a fork that shared the parent's blocks",
    "admit": "an admission that mapped blocks (a cache hit shares them)",
    "readmit": "an admission that mapped blocks (a cache hit shares them)",
    "resume": "an admission that mapped blocks (a cache hit shares them)",
    "land_loads": "an admission that mapped blocks (a cache hit shares them)",
    "evict": "an eviction of cached blocks",
    "evict_blocks": "an eviction of cached blocks",
    "reset_cache": "an eviction of cached blocks",
}
"""Operation -> the path by which its table change releases or takes references, said of what the operation does,
never of what it did right (a leak is a release that did not happen). Operations that change tables
the same way share a path (a preemption or a swap-out releases the whole device table as a free does), so that one
release path is one finding whichever of them met it."""
COMPLETED_STEP = "a completed step that settled deferred releases"
OTHER_PATH = "another operation"


def release_path(operation: str) -> str:
    """The path that released or took the references of the blocks an operation touched, from the operation's label
    (``free('s0')``, ``grow('s1', ...), completing step 3``): the refcount check runs
    on the blocks each operation touched, so the operation it runs in is the one whose release (or take) last
    touched the block."""
    if ", completing step " in operation:
        return COMPLETED_STEP
    name = operation.partition("(")[0]
    return _RELEASE_PATHS.get(name, OTHER_PATH)


def _member_of(block: int, free: Collection[int], cached: Collection[int], pending: Collection[int]) -> list[str]:
    """The names of the allocator's sets that list ``block``, in the order reports give them."""
    return [name for name, blocks in (("free", free), ("cached", cached), ("pending", pending)) if block in blocks]


class AccountingChecks(Checker):
    """Invariants 3 and 4 on the blocks an operation touched, and the pool-wide identity
    free + cached + pending + referenced = every block."""

    def touched(self, touched: Iterable[int]) -> None:
        """Refcounts and set membership of the touched blocks, and the pool-wide counts identity; the blocks seen
        cached (alone in the cached set) noted for the eviction-order check."""
        alloc = self.introspection
        if alloc is None:
            return
        free, cached, pending = alloc.free_blocks(), alloc.cached_blocks(), alloc.pending_blocks()
        seen_cached = self.pools.seen_cached
        for block in touched:
            if block in free and not self.state.refs.holders.get(block):
                self.pools.listed_free(block)
            if self._block(alloc, block, free, cached, pending):
                seen_cached.add(block)
            else:
                seen_cached.discard(block)
        self._pool_wide(free, cached, pending)

    def every_block(self) -> None:
        """Invariants 3 and 4 on every block of the pool, as :meth:`touched` checks the touched ones, changing
        nothing: the audit of the whole observable state that finds where an allocator first departed from the
        model (:mod:`~kvfuzz.engine.checks.divergence`)."""
        alloc = self.introspection
        if alloc is None:
            return
        free, cached, pending = set(alloc.free_blocks()), set(alloc.cached_blocks()), set(alloc.pending_blocks())
        holders, refcount = self.state.refs.holders, alloc.refcount
        for block in range(self.state.num_blocks):
            held = len(holders.get(block, ()))
            listed = (block in free) + (block in cached) + (block in pending)
            if refcount(block) != held or listed != (not held):  # the checks of one block, told why only if broken
                self._block(alloc, block, free, cached, pending)
        self._pool_wide(free, cached, pending)

    def _block(
        self,
        alloc: Introspectable,
        block: int,
        free: Collection[int],
        cached: Collection[int],
        pending: Collection[int],
    ) -> bool:
        """Invariants 3 and 4 on one block; returns whether it is in the cached set alone."""
        holders = self.state.refs.holders.get(block, ())
        found = alloc.refcount(block)
        repeated = sorted({seq for seq, _ in holders if sum(holder == seq for holder, _ in holders) > 1})
        if found < len(holders) and repeated:  # one table lists it twice on one reference: the table is the bug
            self.fail(
                Invariant.REFCOUNTS,
                f"block {block} has refcount {found}, listed {len(holders)} times, twice in the table of {repeated[0]}",
                [
                    f"expected: each block at most once in a table; entries: {self.state.entries(holders)}",
                    *self.pools.block_story(block),
                ],
                Cause("a block repeated in one table"),
            )
        if found != len(holders):
            self.fail(
                Invariant.REFCOUNTS,
                f"block {block} has refcount {found}",
                [
                    f"expected: {len(holders)}, the block-table entries referencing it: "
                    f"{self.state.entries(holders) or 'none'}",
                    *self.pools.block_story(block),
                ],
                (OVER_COUNT if found > len(holders) else UNDER_COUNT).refined(
                    f"last touched by {release_path(self.context.operation)}"
                ),
            )
        in_cached = block in cached
        listed = (block in free) + in_cached + (block in pending)  # how many of the three sets list it
        if holders and listed:
            self.fail(
                Invariant.FREE_SET,
                f"block {block} is referenced by {self.state.entries(holders)} yet listed as "
                f"{' and '.join(_member_of(block, free, cached, pending))}",
                self.pools.block_story(block),
                Cause("a referenced block listed as free, cached or pending"),
            )
        if not holders and listed != 1:
            member_of = " and ".join(_member_of(block, free, cached, pending))
            self.fail(
                Invariant.FREE_SET,
                f"unreferenced block {block} is in {member_of or 'none of the free, cached and pending sets'}",
                ["expected: exactly one of them", *self.pools.block_story(block)],
                Cause("an unreferenced block in none, or several, of the free, cached and pending sets"),
            )
        return in_cached and listed == 1

    def _pool_wide(self, free: Collection[int], cached: Collection[int], pending: Collection[int]) -> None:
        """No more blocks pending than the in-flight window explains, and free + cached + pending + referenced =
        every block."""
        h = self.state
        # With none pending, none can be too many: the window's blocks are listed only when some are.
        in_window = self.context.unreferenced_in_inflight_window() if len(pending) else ()
        if len(pending) > len(in_window):
            self.fail(
                Invariant.FREE_SET,
                f"{len(pending)} block(s) pending, but only {len(in_window)} were "
                f"released within the in-flight window (W = {h.caps.inflight_window})",
                *self._why_pending(pending, in_window),
            )
        total = len(free) + len(cached) + len(pending) + h.refs.num_referenced()
        if total != h.num_blocks:
            self._name_the_block(set(free), set(cached), set(pending))
            self.fail(
                Invariant.FREE_SET,
                f"free + cached + pending + referenced = {len(free)} + {len(cached)} + "
                f"{len(pending)} + {h.refs.num_referenced()} = {total}",
                [f"expected: {h.num_blocks} (every block exactly once)"],
                Cause("the free, cached, pending and referenced blocks do not add up to the pool"),
            )

    def _name_the_block(self, free: set[int], cached: set[int], pending: set[int]) -> None:
        """When the pool's counts do not add up: the first block whose own listing says why (a referenced block
        listed, an unreferenced one in none or several sets), failed with that block's cause, as the audit of every
        block would (one bug, one finding, whether a touched block or the sum noticed it first)."""
        alloc = self.introspection
        if alloc is None:
            return
        holders = self.state.refs.holders
        for block in range(self.state.num_blocks):
            listed = (block in free) + (block in cached) + (block in pending)
            if listed != (not holders.get(block)):
                self._block(alloc, block, free, cached, pending)

    def _why_pending(self, pending: Collection[int], in_window: Sequence[int]) -> tuple[list[str], Cause]:
        """Why one pending block should not be: a table still maps it (it was put in the pending set while live), or
        it was not released within the in-flight window (its window has closed, or it was never released); the
        lines that say so, and that cause."""
        holders = self.state.refs.holders
        mapped = [block for block in pending if block in holders]
        if mapped:
            block = mapped[0]
            return [
                f"block {block} is pending though {self.state.entries(holders[block])} still maps it: it was put in "
                "the pending set while a live sequence holds it",
                "expected: out of the pending set until its last holder releases it",
                *self.pools.block_story(block),
            ], Cause("a block put in the pending set while a live sequence still maps it")
        stuck = next(block for block in pending if block not in in_window)
        return [
            f"block {stuck} is still pending though its window has closed (last completed step: "
            f"{self.pools.last_completed})",
            "expected: it is back in the free or cached set",
            *self.pools.block_story(stuck),
        ], Cause("a block still pending after its in-flight window closed")

    def host_accounting(self, touched: Iterable[int], released_by: str = "") -> None:
        """Invariant 4 on the host pool: each touched host block is in the host free set exactly when no swapped-out
        sequence holds it (a host block shared under ``shares_host_blocks`` until its last holder goes), and the free
        host blocks with the held ones account for every host block once."""
        host = self.host_introspection
        if host is None:
            return
        h = self.state
        held = h.host_holders()
        free = host.host_free_blocks()
        for block in touched:
            holders = held.get(block)
            if holders and block in free:
                named = " and ".join(f"{seq}'s logical block {index}" for seq, index in holders)
                self.fail(
                    Invariant.FREE_SET,
                    f"host block {block} holds swapped-out {named}, yet is listed in the host free set",
                    [
                        "expected: out of the host free set until its "
                        + ("last holder is" if len(holders) > 1 else "sequence is")
                        + " swapped in or freed"
                    ],
                    Cause("a host block that holds a swapped-out sequence listed in the host free set"),
                )
            if not holders and block not in free:
                self.fail(
                    Invariant.FREE_SET,
                    f"host block {block} is held by no swapped-out sequence, yet is not in the host free set"
                    + (f": {released_by} leaked it" if released_by else ""),
                    [
                        "expected: back in host_free_blocks() once no swapped-out sequence holds it",
                        f"found:    host free set {sorted(free)[:20]}",
                    ],
                    Cause("a host block leaked: held by no swapped-out sequence, yet not free"),
                )
        if len(free) + len(held) != h.num_host_blocks:
            self.fail(
                Invariant.FREE_SET,
                f"free + held host blocks = {len(free)} + {len(held)} = {len(free) + len(held)}",
                [
                    f"expected: {h.num_host_blocks} (every host block exactly once)",
                    f"found:    host free set {sorted(free)[:20]}, held {sorted(held)[:20]}",
                ],
                Cause("the free and held host blocks do not add up to the host pool"),
            )

    def fork_table(self, parent: str, child: str, expected: tuple[int, ...], table: tuple[int, ...]) -> None:
        """Invariant 3: the child's table is the parent's, except where fork ordered a copy (``expected``: the parent's
        blocks holding tokens); look-ahead blocks beyond them are the child's own, as ``table_shape`` bounds them."""
        if table[: len(expected)] != expected:
            self.fail(
                Invariant.REFCOUNTS,
                f"fork gave {child} a block table unlike its parent {parent}'s",
                [f"expected: {list(expected)} (shared, or the copies it ordered)", f"found:    {list(table)}"],
                Cause("a forked child's block table unlike its parent's"),
            )
