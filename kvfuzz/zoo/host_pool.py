"""Zoo variants whose slip is in the host pool (swap), caught by the host free set's check at the call that
leaked, where the allocator exposes that set (``host_free_blocks``)."""

from __future__ import annotations

from kvfuzz.allocator.errors import UnknownSequence
from kvfuzz.allocator.paged import PagedAllocator
from kvfuzz.allocator.types import SeqId
from kvfuzz.engine.violations import Invariant
from kvfuzz.zoo.entry import Variant


class HostLeakOnFreeSwapped(PagedAllocator):
    """Class 2, host blocks leaked when a swapped-out request is cancelled: the free path releases the device
    state only, so the host blocks holding the request's K/V are never returned (the abort of a swapped request
    takes a path the finish path never exercises). Without the host free set's check the leak shows only much
    later, as a swap-out refused for want of host blocks.
    """

    def free(self, seq: SeqId) -> None:
        state = self._seqs.get(seq)
        if state is None:
            raise UnknownSequence(f"free: sequence {seq!r} is not live (never admitted, or already freed)")
        if state.host_table is None:
            super().free(seq)
            return
        del self._seqs[seq]
        state.live = False


class OpaqueHostLeakOnFreeSwapped(HostLeakOnFreeSwapped):
    """Class 2, the same host leak in an allocator that shows its device sets but no host free set (no
    ``host_free_blocks``, as an adapter over a library that keeps its host pool private): only the quiescence
    probe of the host pool, a swap-out that needs every host block, sees it.
    """

    host_free_blocks = None  # type: ignore[assignment]  # the slip's setting: the host query is not there


VARIANTS: tuple[Variant, ...] = (
    Variant(
        HostLeakOnFreeSwapped,
        "2 host blocks leaked on cancel",
        Invariant.FREE_SET,
        cause="of a swapped-out sequence leaked it",
    ),
    Variant(
        OpaqueHostLeakOnFreeSwapped,
        "2 host blocks leaked on cancel",
        Invariant.QUIESCENCE,
        cause="some host blocks leaked",
    ),
)
"""This module's slips, in the zoo's order, each with its bug class and the invariant that must catch it."""
