"""Broken allocators for the capabilities of contract v2: each behaves as some real engine does, or slips inside
what it declares, and kvfuzz must name the invariant it breaks. A variant that behaves like a real engine without
declaring it shows that the capability is checked (declared, the same allocator runs clean: see
tests/test_contract_v2.py); a variant that declares it and slips shows that the declaration hides nothing nearby.

Like :mod:`kvfuzz.zoo.variants`, these exist to show kvfuzz at work and to prove, in the test suite, that every
slip is caught and named by the right invariant. Never use them for anything else.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvfuzz.allocator.errors import OutOfBlocks, Unsupported
from kvfuzz.allocator.paged import PagedAllocator
from kvfuzz.allocator.types import Capabilities, GrowResult, SeqId, Tokens
from kvfuzz.engine.violations import Invariant
from kvfuzz.zoo.entry import Variant
from kvfuzz.zoo.variants import MatchableAtAllocation


class PreemptUnsupported(PagedAllocator):
    """An engine with no preemption (it waits for room instead) whose allocator refuses ``preempt`` as unsupported,
    but does not declare ``preemption=False``: kvfuzz calls what is declared, and a valid call refused is a finding.
    """

    def preempt(self, seq: SeqId) -> None:
        raise Unsupported("preempt: this engine never preempts, it waits for room")


class OneBlockPerGrow(PagedAllocator):
    """A grow path written for decode, one token at a time: it adds at most one block per call, so a chunk or a run
    of drafts crossing two block boundaries gets a table one block short. Its engine must declare
    ``single_token_grow``; this one does not.
    """

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        state = self._seqs.get(seq)
        before = len(state.table) if state is not None else 0
        result = super().grow(seq, tokens)
        assert state is not None  # grow refused any sequence that is not running
        for block in reversed(state.table[before + 1 :]):
            self._pool.release(block)
        del state.table[before + 1 :], state.versions[before + 1 :]
        return result


class FullPromptHit(PagedAllocator):
    """Class 9, a hit that covers the whole prompt: when every block of a prompt is cached the allocator reports
    every token cached, leaving the engine no query token to sample from (a request prefilled with zero tokens is
    handed another request's logits). An engine that recomputes the last token itself declares
    ``recomputes_last_token``; this one does not.
    """

    def _usable_hits(self, hits: list[int], num_tokens: int) -> list[int]:
        return hits


class EvictsOnRefusal(PagedAllocator):
    """An allocator that evicts toward a request before finding it still does not fit, then refuses (SGLang and HF
    transformers evict inside allocation): the refusal leaves the cache smaller. Its engine must declare
    ``refusal_evicts``; this one does not, so the refusal is not atomic.
    """

    def _check_room(self, fresh_needed: int, taken_from_evictable: int = 0) -> None:
        try:
            super()._check_room(fresh_needed, taken_from_evictable)
        except OutOfBlocks:
            self._evict_toward_need()
            raise

    def _evict_toward_need(self) -> None:
        """Drop every cached, unreferenced block: the request did not fit even with them."""
        self._pool.evict(self.num_blocks)


class RefusalEvictsReferenced(EvictsOnRefusal):
    """Declares ``refusal_evicts``, but its eviction walks the prefix cache rather than the unreferenced blocks and
    also frees a cached block a running sequence still references (a refcount check missing from the walk), so
    that block can be handed to someone else while it is read.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.capabilities = attrs.evolve(self.capabilities, refusal_evicts=True)

    def _evict_toward_need(self) -> None:
        super()._evict_toward_need()
        referenced = (block for block in range(self.num_blocks) if self._pool.refcount(block))
        for block in [block for block in referenced if self._cache.is_cached(block)][:1]:
            self._cache.unregister(block)
            self._pool._free[block] = None


def _registers_at_allocation(capabilities: Capabilities, **declared: bool) -> Capabilities:
    """The capabilities of an engine that hashes blocks when it allocates them, with an FCFS scheduler that preempts
    only computed requests and keeps the blocks of rejected drafts (no rollback), declaring ``declared`` of the
    three behaviours that follow."""
    changes: dict[str, Any] = {"preempt_scheduled": False, "rollback": False, **declared}
    return attrs.evolve(capabilities, **changes)


class ScheduledHitUnshared(MatchableAtAllocation):
    """Declares that a hit may cover scheduled writes (``hits_scheduled_writes``), but not that the sequences that
    hit may share the block while its owner writes it (``shares_scheduled_blocks``): every such hit puts a second
    holder on a block the next step writes.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.capabilities = _registers_at_allocation(
            self.capabilities, hits_scheduled_writes=True, free_lands_scheduled_writes=True
        )


class AbortKeepsScheduledHash(MatchableAtAllocation):
    """Hashes blocks at allocation, and its engine's abort withdraws the scheduled step (no
    ``free_lands_scheduled_writes``), yet freeing a request before its step leaves its blocks' hashes in the cache:
    a later hit covers K/V no step ever wrote.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.capabilities = _registers_at_allocation(
            self.capabilities, hits_scheduled_writes=True, shares_scheduled_blocks=True
        )


VARIANTS: tuple[Variant, ...] = (
    Variant(
        PreemptUnsupported, "engine without preemption, undeclared", Invariant.MISUSE, cause="refused with Unsupported"
    ),
    Variant(OneBlockPerGrow, "decode-only grow, undeclared", Invariant.REFCOUNTS, cause="block(s) for"),
    Variant(
        FullPromptHit,
        "9 hit covers the whole prompt",
        Invariant.CACHE_SOUNDNESS,
        cause="reports a cache hit of its whole prompt",
    ),
    Variant(
        EvictsOnRefusal,
        "6 refusal that evicts, undeclared",
        Invariant.ATOMIC_REFUSAL,
        cause="refused with OutOfBlocks, but the pool changed",
    ),
    Variant(
        RefusalEvictsReferenced,
        "6 refusal that evicts a referenced block",
        Invariant.ATOMIC_REFUSAL,
        cause="refused with OutOfBlocks, but the pool changed",
    ),
    Variant(
        ScheduledHitUnshared,
        "5 scheduled hit without same-round sharing",
        Invariant.EXCLUSIVE_WRITES,
        cause="while it is shared",
    ),
    Variant(AbortKeepsScheduledHash, "5 withdrawn writes stay matchable", Invariant.CACHE_SOUNDNESS, cause="withdraws"),
)
"""This module's slips, in the zoo's order, each with its bug class and the invariant that must catch it."""
