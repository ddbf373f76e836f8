"""A preemption withdraws a sequence's scheduled writes; a write that would only rewrite, in place, K/V a step has
already written for another holder (``recomputes_last_token`` with ``recomputes_in_place``: vLLM v0 recomputes a
fully cached prompt's last token inside the cached block) withdraws nothing anyone relies on. (One that a holder's
hit does rely on stays a violation: tests/test_contract_v2.py, zoo ``AbortKeepsScheduledHash``, Finding 3.)"""

from __future__ import annotations

import attrs

from kvfuzz.allocator.paged import PagedAllocator
from kvfuzz.engine import Engine
from kvfuzz.statemachines import MachineConfig

CONFIG = MachineConfig(block_size=1, num_blocks=4, num_host_blocks=0)


class _HitsWholePrompt(PagedAllocator):
    """kvfuzz's allocator (W = 0) whose hit may cover the whole prompt: the engine rewrites its last token in place
    inside the shared cached block, as vLLM v0 does."""

    def __init__(self) -> None:
        super().__init__(CONFIG.block_size, CONFIG.num_blocks)
        self.capabilities = attrs.evolve(
            self.capabilities,
            recomputes_last_token=True,
            recomputes_in_place=True,
            complete_caching=False,
            eviction_order=None,
        )

    def _usable_hits(self, hits: list[int], num_tokens: int) -> list[int]:
        return hits


def test_preempting_a_sequence_that_rewrites_a_written_block_in_place_is_not_reported() -> None:
    engine = Engine(_HitsWholePrompt(), CONFIG)
    engine.admit("s0", (), (1, 0))
    engine.step()
    engine.admit("s1", (), (1,))  # a hit of its whole prompt: block 0, rewritten in place at the next step
    assert engine.expected.seqs["s1"].table == engine.expected.seqs["s0"].table[:1]
    engine.preempt("s1")
    engine.step()
    engine.quiesce()
