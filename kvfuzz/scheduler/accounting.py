"""The manager's accounting against the worker's tables, checked right after the worker has read a
``SchedulerOutput`` (when, under synchronous scheduling, both know of the same finished and preempted requests).

What is provable from the tables alone, with the prefix cache on or off: a block in the table of a live request (one
the worker holds, not preempted) is in use, so its ``ref_cnt`` is the number of live tables holding it and it is not
in the free queue; every other block but the null block (free, or cached but free: an evictable prefix-cache block
has ``ref_cnt`` 0 and sits in the free queue) is free. So the free count is the usable blocks less the distinct blocks
of the live tables. Which free blocks are still cached is not provable from the tables, and is not checked."""

from __future__ import annotations

from typing import Any

from kvfuzz.scheduler.violations import Check, SchedulerViolation


def check_accounting(scheduler: Any, tables: dict[str, list[int]], step: int) -> None:
    """Raise :class:`SchedulerViolation` where the manager's block pool disagrees with the live ``tables``."""
    pool = scheduler.kv_cache_manager.block_pool
    holders: dict[int, list[str]] = {}
    for request, table in tables.items():
        for block in table:
            holders.setdefault(block, []).append(request)
    free = {block.block_id for block in pool.free_block_queue.get_all_free_blocks()}
    for block, requests in sorted(holders.items()):
        count = pool.blocks[block].ref_cnt
        if block in free or count != len(requests):
            where = "is in the free queue" if block in free else f"has ref_cnt {count}"
            raise SchedulerViolation(
                Check.ACCOUNTING,
                step,
                requests[0],
                f"block {block} is held by the tables of {len(requests)} running request(s) {requests} "
                f"(expected ref_cnt {len(requests)}, not free), but the manager's block {where}",
                "a held block in the free queue" if block in free else "a held block's ref_cnt",
            )
    usable = len(pool.blocks) - 1  # the null block is never free nor held
    reported = pool.get_num_free_blocks()
    if reported != usable - len(holders):
        leaked = sorted(
            block.block_id for block in pool.blocks[1:] if block.block_id not in free and block.block_id not in holders
        )
        raise SchedulerViolation(
            Check.ACCOUNTING,
            step,
            None,
            f"the manager reports {reported} free blocks, but the running requests' tables hold {len(holders)} "
            f"distinct blocks of {usable}, so {usable - len(holders)} must be free; blocks neither free nor in a "
            f"table: {leaked}",
            "the free count",
        )
