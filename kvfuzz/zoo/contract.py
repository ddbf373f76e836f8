"""Broken allocators for the capabilities of contract v2: each behaves as some real engine does, or slips inside
what it declares, and kvfuzz must name the invariant it breaks. A variant that behaves like a real engine without
declaring it shows that the capability is checked (declared, the same allocator runs clean: see
tests/test_contract_v2.py); a variant that declares it and slips shows that the declaration hides nothing nearby.

Like :mod:`kvfuzz.zoo.variants`, these exist to show kvfuzz at work and to prove, in the test suite, that every
slip is caught and named by the right invariant. Never use them for anything else.
"""

from __future__ import annotations

from kvfuzz.allocator.errors import Unsupported
from kvfuzz.allocator.paged import PagedAllocator
from kvfuzz.allocator.types import GrowResult, SeqId, Tokens


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
