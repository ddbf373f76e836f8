"""A zoo entry: one broken allocator, its bug class, and the invariant kvfuzz must name when it catches it."""

from __future__ import annotations

from typing import Callable, Optional, Union

import attrs

from kvfuzz.allocator.hybrid import HybridAllocator
from kvfuzz.allocator.paged import PagedAllocator
from kvfuzz.allocator.types import PoolSpec
from kvfuzz.engine.violations import Invariant

ZooAllocator = Union[PagedAllocator, HybridAllocator]
"""What a zoo variant subclasses: kvfuzz's allocator, or its hybrid (KV-cache groups) allocator."""


@attrs.frozen
class Variant:
    """One broken allocator: its class, the bug class (docs/invariants.md) it belongs to, the invariant that must
    catch it and the phrase of its explanation that names the slip, the in-flight window it declares and, for
    sliding-window slips, its window in tokens; for look-ahead slips, its look-ahead blocks. A deep variant
    (:mod:`kvfuzz.zoo.deep`) is one the default ``kvfuzz run`` misses in most seeds: its trigger needs pool pressure,
    a long program, a rollback or swap at a particular moment, or a tiny pool."""

    allocator: type[ZooAllocator]
    bug_class: str
    expected: Invariant
    inflight_window: int = 1
    sliding_window: Optional[int] = None
    deep: bool = False  # reached by campaigns (swarmed pools, long programs), rarely by a default run
    lookahead_blocks: int = 0  # the look-ahead it allocates and declares (look-ahead slips)
    # A phrase its failure's explanation must contain, naming the slip it seeds: the cause a person reads
    # (tests/test_zoo.py checks it against the bug that is really there). None: its explanation does not name the slip
    # yet (the test lists what it says instead).
    cause: Optional[str] = None

    @property
    def name(self) -> str:
        return self.allocator.__name__

    @property
    def description(self) -> str:
        return " ".join((self.allocator.__doc__ or "").split())

    def factory(self) -> Callable[[PoolSpec], ZooAllocator]:
        def build(spec: PoolSpec) -> ZooAllocator:
            return self.allocator(
                spec.block_size,
                spec.num_blocks,
                spec.num_host_blocks,
                inflight_window=self.inflight_window if spec.inflight_window is None else spec.inflight_window,
                sliding_window=self.sliding_window,
                lookahead_blocks=self.lookahead_blocks,
            )

        build.__name__ = self.name
        return build
