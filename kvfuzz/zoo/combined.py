"""Allocators carrying more than one of the zoo's bugs, for campaigns: one bug must not hide another behind it.

``shallow_and_deep`` carries :class:`~kvfuzz.zoo.variants.NoCopyOnWrite` (a fork followed by a grow: found in the
first examples) and :class:`~kvfuzz.zoo.variants.SwapInWrongHostBlock` (a sequence of two or more blocks swapped
out and back in, then read: rarer). A campaign against it must report both; the traces it saves each replay against
the one variant whose bug they show.

The others pair two bugs that break the same invariant in the same operation for different reasons, which a
signature of invariant and operation alone merged into one finding (the second bug hidden behind the first):
``whole_prompt_and_namespace`` (cache soundness on admit: a hit covering the whole prompt, and a hit on another
namespace's K/V), ``unwritten_and_namespace`` (cache soundness on admit: a hit on K/V no step wrote yet, and a hit
on another namespace's K/V) and ``refcount_over_and_under`` (refcounts: a free that leaves shared blocks' refcounts
too high, and a preemption that releases one block twice). ``under_count_two_paths`` pairs two bugs with the same
cause, a refcount below the table entries, reached by different paths (a preemption that releases one block twice,
and a grow after a rollback that appends the sequence's last block again without taking a reference): the path
that released or took the block tells them apart. :data:`COMBINED` lists each with its bugs.
"""

from __future__ import annotations

from typing import Callable

import attrs

from kvfuzz.allocator.paged import PagedAllocator
from kvfuzz.allocator.types import PoolSpec
from kvfuzz.zoo import contract, variants
from kvfuzz.zoo.contract import FullPromptHit
from kvfuzz.zoo.entry import Variant
from kvfuzz.zoo.variants import (
    FreeForgetsSharedRefcount,
    KeyWithoutNamespace,
    MatchableAtAllocation,
    NoCopyOnWrite,
    ReleasedTwiceOnPreempt,
    RepeatedBlockAfterRollback,
    SwapInWrongHostBlock,
)


class ShallowAndDeep(NoCopyOnWrite, SwapInWrongHostBlock):
    """Copy-on-write missing (NoCopyOnWrite) and swap-in mapping the wrong host blocks (SwapInWrongHostBlock)."""


class WholePromptAndNamespace(FullPromptHit, KeyWithoutNamespace):
    """A hit covering the whole prompt (FullPromptHit) and a cache key without the namespace (KeyWithoutNamespace)."""


class UnwrittenAndNamespace(MatchableAtAllocation, KeyWithoutNamespace):
    """Blocks matchable before they are written (MatchableAtAllocation) and a cache key without the namespace
    (KeyWithoutNamespace)."""


class RefcountOverAndUnder(FreeForgetsSharedRefcount, ReleasedTwiceOnPreempt):
    """A free that skips shared blocks (FreeForgetsSharedRefcount) and a preemption that releases a block twice
    (ReleasedTwiceOnPreempt)."""


class UnderCountTwoPaths(ReleasedTwiceOnPreempt, RepeatedBlockAfterRollback):
    """A preemption that releases a block twice (ReleasedTwiceOnPreempt) and a grow after a rollback that maps a
    block twice on one reference (RepeatedBlockAfterRollback): both leave a refcount below the table entries, by
    different paths."""


def _factory(allocator: type[PagedAllocator]) -> Callable[[PoolSpec], PagedAllocator]:
    def build(spec: PoolSpec) -> PagedAllocator:
        return allocator(spec.block_size, spec.num_blocks, spec.num_host_blocks, inflight_window=1)

    return build


shallow_and_deep = _factory(ShallowAndDeep)
"""``kvfuzz.zoo.combined:shallow_and_deep``: both bugs, W = 1 like the zoo's variants."""
whole_prompt_and_namespace = _factory(WholePromptAndNamespace)
unwritten_and_namespace = _factory(UnwrittenAndNamespace)
refcount_over_and_under = _factory(RefcountOverAndUnder)
under_count_two_paths = _factory(UnderCountTwoPaths)


@attrs.frozen
class Combined:
    """One allocator of several zoo bugs: its factory's name in this module, and the variants whose bugs it
    carries (each of which a campaign against it must report)."""

    factory: str
    bugs: tuple[Variant, ...]

    @property
    def spec(self) -> str:
        return f"kvfuzz.zoo.combined:{self.factory}"


def _variants(*classes: type) -> tuple[Variant, ...]:
    return tuple(v for v in (*variants.VARIANTS, *contract.VARIANTS) if v.allocator in classes)


COMBINED: tuple[Combined, ...] = (
    Combined("shallow_and_deep", _variants(NoCopyOnWrite, SwapInWrongHostBlock)),
    Combined("whole_prompt_and_namespace", _variants(FullPromptHit, KeyWithoutNamespace)),
    Combined("unwritten_and_namespace", _variants(MatchableAtAllocation, KeyWithoutNamespace)),
    Combined("refcount_over_and_under", _variants(FreeForgetsSharedRefcount, ReleasedTwiceOnPreempt)),
    Combined("under_count_two_paths", _variants(ReleasedTwiceOnPreempt, RepeatedBlockAfterRollback)),
)
"""Every combined allocator of this module, with its bugs."""
