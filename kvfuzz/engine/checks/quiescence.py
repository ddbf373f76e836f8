"""Invariant 10, quiescence: once every sequence is gone and the in-flight work done, every block is free."""

from __future__ import annotations

import collections.abc
import itertools

from kvfuzz.allocator.errors import OutOfBlocks
from kvfuzz.engine.checks.accounting import AccountingChecks
from kvfuzz.engine.checks.context import CheckContext, Checker
from kvfuzz.engine.violations import Invariant


class Quiescence(Checker):
    """Invariant 10, through the allocator's sets where it shows them, else by admitting a whole-pool probe."""

    def __init__(self, context: CheckContext, accounting: AccountingChecks) -> None:
        super().__init__(context)
        self.accounting = accounting  # invariants 3 and 4, over the whole pool first

    def check(self) -> None:
        """Every sequence is gone and the in-flight work done: every block is free (and accounted for)."""
        if self.introspection is not None:
            self.accounting.touched(())
            self.quiescent()
        else:
            self.whole_pool_admissible(self.state.new_id())

    def quiescent(self) -> None:
        h = self.state
        alloc = self.introspection
        if alloc is None:
            return
        for block in self.pools.history:
            if alloc.refcount(block) != 0:
                self.fail(
                    Invariant.QUIESCENCE,
                    f"every sequence is gone, yet block {block} has refcount {alloc.refcount(block)}",
                    self.pools.block_story(block),
                )
        free, cached, pending = alloc.free_blocks(), alloc.cached_blocks(), alloc.pending_blocks()
        reusable = len(free) + (0 if h.caps.eviction else len(cached))
        if reusable != h.num_blocks or len(pending):
            lost = sorted(set(range(h.num_blocks)) - set(free) - set(cached))
            self.fail(
                Invariant.QUIESCENCE,
                f"every sequence is gone and the cache reset, yet only {reusable} of {h.num_blocks} blocks are free",
                [
                    f"pending: {len(pending)}",
                    f"leaked: {lost[:20]}",
                    *(line for block in lost[:2] for line in self.pools.block_story(block)),
                ],
            )
        if not isinstance(free, collections.abc.Set) and len(set(free)) != len(free):
            duplicated = sorted(block for block, n in collections.Counter(free).items() if n > 1)
            self.fail(
                Invariant.QUIESCENCE,
                f"the free set lists block(s) {duplicated} more than once",
                self.pools.block_story(duplicated[0]),
            )
        host = self.host_introspection
        if host is not None:
            host_free = host.host_free_blocks()
            if len(host_free) != h.num_host_blocks or set(host_free) != set(range(h.num_host_blocks)):
                self.fail(
                    Invariant.QUIESCENCE,
                    f"every sequence is gone, yet the host free set holds {len(host_free)} entries for "
                    f"{h.num_host_blocks} host blocks",
                    [
                        f"expected: every host block 0..{h.num_host_blocks - 1} free, once",
                        f"leaked:   {sorted(set(range(h.num_host_blocks)) - set(host_free))[:20]}",
                    ],
                )

    def whole_pool_admissible(self, probe: str) -> None:
        """Invariant 10 without introspection: leaks show as a refusal, so one sequence as large as the whole pool
        (less the reserved blocks) must be admitted, then it is freed."""
        h = self.state
        usable = (h.num_blocks - h.caps.reserved_blocks) // max(1, len(h.caps.kv_groups))  # every group needs its own
        tokens = tuple(itertools.islice(itertools.cycle(range(97, 101)), usable * h.block_size))
        try:
            self.allocator.admit(probe, ("kvfuzz-quiescence-probe",), tokens)
        except OutOfBlocks as error:
            self.fail(
                Invariant.QUIESCENCE,
                f"every sequence is gone, yet a {usable}-block sequence is refused: {error}",
                ["some blocks leaked"],
            )
        self.allocator.free(probe)
