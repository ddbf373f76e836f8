"""The accounting check of SGLang's token pool, after every step: each allocatable page (``1 .. num_blocks``; page
0 is SGLang's padding page) is exactly one of free in the allocator, or held (by a live request's ``req_to_token``
row, up to its allocated length, or by a radix-tree node); and the tree's ``evictable_size() + protected_size()``
is the tokens its nodes hold (``all_values_flatten``; which of them are locked is not readable: the Rust tree core
of ``UnifiedRadixCache`` exposes no nodes). A page both free and held, or
neither, is a leak or a double use; the failure names it."""

from __future__ import annotations

from typing import Any

from kvfuzz.scheduler.violations import Check, SchedulerViolation


def check_accounting(loop: Any, step: int) -> None:
    """Raise :class:`SchedulerViolation` where SGLang's pools disagree with what the requests and the tree hold."""
    pools, page = loop.pools, loop.setup.block_size
    free = {int(p) for p in pools.token_pool.get_all_free_pages().tolist()}
    holders: dict[int, str] = {}
    rows = pools.req_to_token_pool.req_to_token
    for rid, req in loop.requests.items():
        if req.kv.holds_kv:
            for slot in rows[req.kv.req_pool_idx, : req.kv.kv_allocated_len].tolist():
                holders.setdefault(int(slot) // page, f"request {rid}'s row")
    tree = pools.tree_cache
    tree_tokens = 0
    if not tree.disable:
        values = tree.all_values_flatten().tolist()  # every slot the tree's nodes hold
        tree_tokens = len(values)
        for slot in values:
            holders.setdefault(int(slot) // page, "the radix tree")
    for number in range(1, loop.setup.num_blocks + 1):
        held, is_free = number in holders, number in free
        if held == is_free:
            detail = (
                f"is free and held by {holders[number]}"
                if held
                else "is neither free nor held by any request or the tree"
            )
            cause = "a page both free and held" if held else "a page neither free nor held"
            raise SchedulerViolation(Check.ACCOUNTING, step, None, f"page {number} {detail}", cause)
    if not tree.disable:
        evictable, locked = int(tree.evictable_size()), int(tree.protected_size())
        if evictable + locked != tree_tokens:
            raise SchedulerViolation(
                Check.ACCOUNTING,
                step,
                None,
                f"the radix tree reports {evictable} evictable and {locked} protected tokens, but its nodes hold "
                f"{tree_tokens}",
                "the radix tree's token count",
            )
