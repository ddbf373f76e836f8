"""A fixed per-request reservation, behind the paged contract: the layout serving engines used before paging.

Each sequence is given one contiguous region of ``block_size`` positions when it is admitted, and holds it whole
until it finishes: the reservation is sized for the longest request it will serve, so most of it sits unused (the
waste paging removes). In the contract's terms a region is one block: a sequence's table names its region, and
position ``p`` lives at offset ``p`` of it. A sequence that outgrows its region is given another whole region, as
the contract's table rule (``ceil(len / block_size)`` blocks) demands; a run sizes the reservation so that this never
happens. Nothing is shared: no prefix cache and no fork (the engine admits each parallel sample with its own copy of
the prompt), no swap, no rollback. Released regions are free at once (no in-flight window).
"""

from __future__ import annotations

from typing import Collection

from kvfuzz.allocator.errors import InvalidArgument, OutOfBlocks, SequenceExists, UnknownSequence
from kvfuzz.allocator.types import (
    AdmitResult,
    Capabilities,
    GrowResult,
    Namespace,
    PoolSpec,
    SeqId,
    Slot,
    Tokens,
)


class ReservationAllocator:
    """Whole regions of ``block_size`` positions, one per sequence (more only if it outgrows one).

    Invariant: every region is either in ``_free`` or in exactly one live sequence's table, never both."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size  # positions in one reservation
        self.num_blocks = num_blocks  # reservations the pool holds
        self.num_host_blocks = 0  # no host pool
        # A fixed reservation shares nothing, has no host pool, drops no tokens and caches nothing: no fork, swap,
        # rollback or eviction, and none of their methods.
        self.capabilities = Capabilities(introspection=True)
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))  # regions no sequence holds, oldest first
        self._lengths: dict[SeqId, int] = {}  # live sequence -> its tokens
        self._tables: dict[SeqId, list[int]] = {}  # live sequence -> its regions

    def _regions_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _take(self, count: int, op: str) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocks(
                f"{op}: needs {count} reservation(s) of {self.block_size} positions, {len(self._free)} free",
                needed=count,
                available=len(self._free),
            )
        taken = list(self._free)[:count]
        for region in taken:
            del self._free[region]
        return taken

    def _live(self, seq: SeqId, op: str) -> list[int]:
        if seq not in self._tables:
            raise UnknownSequence(f"{op}: sequence {seq!r} is not live")
        return self._tables[seq]

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        if seq in self._tables:
            raise SequenceExists(f"admit: sequence {seq!r} is already live")
        if not tokens:
            raise InvalidArgument(f"admit: sequence {seq!r} has no tokens")
        self._tables[seq] = self._take(self._regions_for(len(tokens)), "admit")
        self._lengths[seq] = len(tokens)
        return AdmitResult(tuple(self._tables[seq]), 0)

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        table = self._live(seq, "grow")
        if not tokens:
            raise InvalidArgument(f"grow: sequence {seq!r} given no tokens")
        old, new = self._lengths[seq], self._lengths[seq] + len(tokens)
        table += self._take(self._regions_for(new) - len(table), "grow")
        self._lengths[seq] = new
        size = self.block_size
        return GrowResult(tuple(Slot(table[p // size], p % size) for p in range(old, new)))

    def free(self, seq: SeqId) -> None:
        for region in self._live(seq, "free"):
            self._free[region] = None
        del self._tables[seq], self._lengths[seq]

    def preempt(self, seq: SeqId) -> None:
        self.free(seq)

    def step_completed(self, step: int) -> None:
        """Regions are released at once; a completed step changes nothing."""

    def block_table(self, seq: SeqId) -> tuple[int, ...]:
        return tuple(self._live(seq, "block_table"))

    # -- introspection -------------------------------------------------------------------------------------------

    def refcount(self, block: int) -> int:
        return sum(block in table for table in self._tables.values())

    def free_blocks(self) -> Collection[int]:
        return self._free.keys()

    def cached_blocks(self) -> Collection[int]:
        return ()

    def pending_blocks(self) -> Collection[int]:
        return ()


def reservation_allocator(spec: PoolSpec) -> ReservationAllocator:
    """A fixed reservation of ``spec.block_size`` positions per request, ``spec.num_blocks`` of them."""
    return ReservationAllocator(spec.block_size, spec.num_blocks)
