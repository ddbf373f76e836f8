"""Invariant 10, quiescence: once every sequence is gone and the in-flight work done, every block is free, on the
device and, for an allocator that swaps, on the host."""

from __future__ import annotations

import collections.abc
import itertools
from typing import Optional, cast

from kvfuzz.allocator.errors import OutOfBlocks
from kvfuzz.allocator.protocol import Swaps
from kvfuzz.allocator.types import SeqId
from kvfuzz.engine.checks.accounting import AccountingChecks
from kvfuzz.engine.checks.context import CheckContext, Checker
from kvfuzz.engine.violations import Cause, Invariant

LEAKED_REFERENCE = Cause("a reference never released: a block still counted referenced once every sequence is gone")
LEAKED_BLOCKS = Cause("blocks leaked: fewer blocks reusable than the pool once every sequence is gone")
LEAKED_HOST_BLOCKS = Cause("host blocks leaked: fewer host blocks free than the host pool once every sequence is gone")


class Quiescence(Checker):
    """Invariant 10, through the allocator's sets where it shows them, else by admitting a whole-pool probe."""

    def __init__(self, context: CheckContext, accounting: AccountingChecks) -> None:
        super().__init__(context)
        self.accounting = accounting  # invariants 3 and 4, over the whole pool first

    def check(self) -> None:
        """Every sequence is gone and the in-flight work done: every block is free (and accounted for), the host
        pool's too, probed by swapping out where the allocator swaps but shows no host free set."""
        h = self.state
        probes_host = self.host_introspection is None and h.caps.swap and h.num_host_blocks > 0
        probes: list[SeqId] = []
        if self.introspection is not None:
            self.accounting.touched(())
            self.quiescent()
        else:
            probes = self.whole_pool_admissible(h.num_host_blocks if probes_host else 0)
        if probes_host:
            probes += self.host_pool_swappable(probes[0] if probes else None)
        for probe in probes:
            self.allocator.free(probe)

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
                    LEAKED_REFERENCE,
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
                LEAKED_BLOCKS,
            )
        if not isinstance(free, collections.abc.Set) and len(set(free)) != len(free):
            duplicated = sorted(block for block, n in collections.Counter(free).items() if n > 1)
            self.fail(
                Invariant.QUIESCENCE,
                f"the free set lists block(s) {duplicated} more than once",
                self.pools.block_story(duplicated[0]),
                Cause("a block listed in the free set more than once (released twice)"),
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
                    LEAKED_HOST_BLOCKS,
                )

    def usable(self) -> int:
        """Blocks one sequence can be given in an empty device pool: the pool less the reserved blocks, shared by the
        KV-cache groups (each needs its own)."""
        h = self.state
        return (h.num_blocks - h.caps.reserved_blocks) // max(1, len(h.caps.kv_groups))

    def probe(self, size: int, part: int) -> SeqId:
        """Admit a probe sequence of ``size`` blocks, in a namespace of its own (no probe hits another's blocks);
        ``OutOfBlocks`` is the caller's to judge."""
        probe = self.state.new_id()
        tokens = tuple(itertools.islice(itertools.cycle(range(97, 101)), size * self.state.block_size))
        self.allocator.admit(probe, ("kvfuzz-quiescence-probe", *((str(part),) if part else ())), tokens)
        return probe

    def whole_pool_admissible(self, host_blocks: int) -> list[SeqId]:
        """Invariant 10 without introspection: leaks show as a refusal, so sequences as large as the whole pool
        (less the reserved blocks) together must be admitted: one, or, to probe ``host_blocks`` host blocks, a first
        of that many blocks and a second of the rest. Returns them, admitted (the caller frees them)."""
        usable = self.usable()
        sizes = [host_blocks, usable - host_blocks] if 0 < host_blocks < usable else [usable]
        probes: list[SeqId] = []
        for part, size in enumerate(sizes):
            try:
                probes.append(self.probe(size, part))
            except OutOfBlocks as error:
                self.fail(
                    Invariant.QUIESCENCE,
                    f"every sequence is gone, yet a {usable}-block sequence is refused: {error}"
                    if len(sizes) == 1
                    else f"every sequence is gone, yet {' + '.join(map(str, sizes))} blocks in {len(sizes)} sequences "
                    f"are refused: {error}",
                    ["some blocks leaked"],
                    LEAKED_BLOCKS,
                )
        return probes

    def host_pool_swappable(self, admitted: Optional[SeqId]) -> list[SeqId]:
        """Invariant 10 on the host pool of an allocator that swaps but shows no host free set: leaked host blocks
        show as a refused swap-out. Sequences that together need every host block are swapped out in turn, which
        must succeed: ``admitted`` (a probe of :meth:`whole_pool_admissible`, as many blocks as the host pool has,
        or the whole device pool when that is smaller) first, then new probes. A device pool smaller than the host
        pool is reused round after round; in a non-zero in-flight window the blocks a swap-out released are still
        pending, and the probe ends with the rounds it could admit. Returns the probes it admitted itself (the
        caller frees them, and ``admitted``)."""
        h = self.state
        usable = self.usable()
        probes: list[SeqId] = []
        left = h.num_host_blocks
        while left > 0 and usable > 0:
            size = min(left, usable)
            if admitted is not None:
                probe, admitted = admitted, None
            else:
                try:
                    probe = self.probe(size, len(probes) + 2)
                except OutOfBlocks as error:
                    if probes or self.introspection is None:
                        break  # the device blocks of the last swap-out are still pending: no leak, no more room
                    self.fail(  # its sets showed every device block free, yet it refuses
                        Invariant.QUIESCENCE,
                        f"every sequence is gone, yet a {size}-block probe of the host pool is refused: {error}",
                        ["some blocks leaked"],
                        LEAKED_BLOCKS,
                    )
                probes.append(probe)
            try:
                cast(Swaps, self.allocator).swap_out(probe)
            except OutOfBlocks as error:
                self.fail(
                    Invariant.QUIESCENCE,
                    f"every sequence is gone, yet swapping out {size} block(s) with {left} of {h.num_host_blocks} "
                    f"host blocks unused is refused: {error}",
                    ["some host blocks leaked (the allocator shows no host free set, host_free_blocks)"],
                    LEAKED_HOST_BLOCKS,
                )
            left -= size
        return probes
