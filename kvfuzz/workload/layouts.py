"""The pool layouts a serving comparison runs: paging at a block size (with or without its prefix cache), and a
fixed per-request reservation; each builds its allocator behind the same contract, for a pool of given positions."""

from __future__ import annotations

from typing import Callable

import attrs

from kvfuzz.allocator.paged import paged_allocator, unshared_allocator
from kvfuzz.allocator.protocol import AllocatorProtocol
from kvfuzz.allocator.reservation import reservation_allocator
from kvfuzz.allocator.types import PoolSpec
from kvfuzz.engine.config import MachineConfig


@attrs.frozen
class PoolLayout:
    """One layout: ``block_size`` positions per block (the whole reservation, for a reservation) in a pool of
    ``pool_positions`` positions, a multiple of it."""

    label: str  # how tables name it
    name: str  # the factory, as --allocator would name it
    factory: Callable[[PoolSpec], AllocatorProtocol]  # builds the allocator for the pool
    block_size: int  # positions per block (per reservation)
    pool_positions: int  # positions in the pool

    def __attrs_post_init__(self) -> None:
        if self.pool_positions % self.block_size:
            raise ValueError(f"{self.label}: a pool of {self.pool_positions} positions is not whole blocks")

    def config(self, kernel: str = "gather") -> MachineConfig:
        return MachineConfig(
            block_size=self.block_size,
            num_blocks=self.pool_positions // self.block_size,
            num_host_blocks=0,
            kernel=kernel,
        )


def paged(block_size: int, pool_positions: int, sharing: bool = True) -> PoolLayout:
    """Paging with kvfuzz's allocator (prefix cache on unless ``sharing`` is False)."""
    if sharing:
        return PoolLayout(
            f"paged B={block_size}",
            "kvfuzz.allocator.paged:paged_allocator",
            paged_allocator,
            block_size,
            pool_positions,
        )
    return PoolLayout(
        f"paged B={block_size}, no prefix cache",
        "kvfuzz.allocator.paged:unshared_allocator",
        unshared_allocator,
        block_size,
        pool_positions,
    )


def reservation(positions: int, pool_positions: int) -> PoolLayout:
    """A fixed reservation of ``positions`` per request."""
    return PoolLayout(
        f"reserve {positions}",
        "kvfuzz.allocator.reservation:reservation_allocator",
        reservation_allocator,
        positions,
        pool_positions,
    )
