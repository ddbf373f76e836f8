"""Two scheduler-level KV-cache bugs from vLLM v1's history (one reported as issue #11562, one named in the review of
its fix), put back into vLLM 0.33.0 at runtime (the installed package is never edited): each function takes a
``pytest.MonkeyPatch`` and patches the fix back out, so the scheduler behaves as it did before the fix until the
monkeypatch is undone.

Both live where the scheduler admits a waiting request whose prompt hits the prefix cache: ``allocate_slots`` must
take a reference on the hit blocks ("touch" them, which also takes an evictable hit block out of the free queue)
and allocate the blocks the rest of the prompt needs, or refuse the request and leave the pool as it was."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import pytest
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager


def touch_before_the_capacity_check(patch: pytest.MonkeyPatch) -> None:
    """vLLM issue #11562, "[Bug]: assert total_num_scheduled_tokens > 0", fixed by pull request #11565, "[Bugfix]
    Move the _touch(computed_blocks) call in the allocate_slots method to after the check for allocating new
    blocks".

    Before the fix, ``allocate_slots`` touched a request's prefix-hit blocks first and checked for enough free
    blocks after; when the check failed it returned None (the scheduler leaves the request waiting) without
    undoing the touch. Each refused admission of a request with a hit leaked one reference on every hit block:
    the blocks stay out of the free queue with a ``ref_cnt`` no request accounts for, and the pool shrinks until
    the engine restarts. The fix touches only once the allocation is sure to succeed.

    Reconstructed on 0.33.0's structure: when ``allocate_slots`` refuses a request that came with hit blocks, the
    touch it would have done before the check is done anyway."""
    original = KVCacheManager.allocate_slots

    def allocate_slots(
        self: KVCacheManager,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Optional[KVCacheBlocks] = None,
        *args: Any,
        **kwargs: Any,
    ) -> Optional[KVCacheBlocks]:
        allocated = original(
            self, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, *args, **kwargs
        )
        if allocated is None and new_computed_blocks is not None and self.enable_caching:
            for group in new_computed_blocks.blocks:
                self.block_pool.touch(group)
        return allocated

    patch.setattr(KVCacheManager, "allocate_slots", allocate_slots)


def capacity_check_ignores_evictable_hits(patch: pytest.MonkeyPatch) -> None:
    """The hazard the review of vLLM pull request #11565 named before it merged: once the touch comes after the
    capacity check, the check must count the prefix-hit blocks that are evictable (cached, ``ref_cnt`` 0, in the
    free queue), since touching them takes them out of the free queue the new blocks are drawn from (the review's
    example: 4 blocks needed, 5 free, 2 of them hits). Pull request #11310 ("[V1] Simplify prefix caching logic by
    removing `num_evictable_computed_blocks`") had dropped that count as always zero while the touch came first;
    the pull request's first version moved the touch without counting them again, and the merged code counts them,
    as 0.33.0 does in ``get_num_blocks_to_allocate``. This is a regression caught in review, not one released.

    Without the count the check passes a request whose new blocks fit only if its evictable hits stay free; the
    touch then takes them, and the block pool cannot hand out the new blocks: ``get_new_blocks`` raises in the
    middle of ``schedule()``, which kills the engine core.

    Reconstructed on 0.33.0's structure: the evictable hit blocks are counted as none."""

    def no_evictable_blocks(cls: type, blocks: Sequence[Any]) -> int:
        return 0

    patch.setattr(SingleTypeKVCacheManager, "_get_num_evictable_blocks", classmethod(no_evictable_blocks))
