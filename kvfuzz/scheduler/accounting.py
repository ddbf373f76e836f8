"""The manager's accounting against the worker's tables, checked right after the worker has read a
``SchedulerOutput`` (when, under synchronous scheduling, both know of the same finished and preempted requests).

What is provable from the tables alone, with the prefix cache on or off, across every KV-cache group (vLLM's hybrid
allocator gives all groups one block pool, so a block's ``ref_cnt`` counts the tables of every group holding it): a
block in a table entry a live request (one the worker holds, not preempted) still needs is in use, so its ``ref_cnt``
is at least the number of such entries holding it, at most that plus the entries that may still hold it (a
sliding-window group's entries wholly before its window, which vLLM frees when it next allocates for the request),
and it is not in the free queue; every other block but the null block (free, or cached but free: an evictable
prefix-cache block has ``ref_cnt`` 0 and sits in the free queue) is free. So the free count is the usable blocks
less the distinct blocks held, less some of those that may be. With full attention alone nothing is "may be", and
every bound is exact. Which free blocks are still cached is not provable from the tables, and is not checked."""

from __future__ import annotations

from typing import Any, Collection, Optional

from kvfuzz.scheduler.violations import Check, SchedulerViolation

WAITING_QUEUE = "vLLM's waiting queue, for requests that hold no blocks"
"""How a message names vLLM's waiting queue (a request there should hold no blocks)."""

WAITING_CAUSE = "blocks held by a request in the waiting queue"
"""The cause of a block count off because requests in vLLM's waiting queue hold blocks: one vLLM bug, whether the
blocks are theirs alone (the free count sees it) or shared with a running request (its ``ref_cnt`` shows it)."""


def _holders(tables: dict[str, list[int]]) -> dict[int, list[str]]:
    holders: dict[int, list[str]] = {}
    for request, table in tables.items():
        for block in table:
            holders.setdefault(block, []).append(request)
    return holders


def check_accounting(
    scheduler: Any, tables: dict[str, list[int]], step: int, maybe: Optional[dict[str, list[int]]] = None
) -> None:
    """Raise :class:`SchedulerViolation` where the manager's block pool disagrees with the live ``tables`` (the
    blocks each request must hold) and ``maybe`` (those it may hold or may have released)."""
    pool = scheduler.kv_cache_manager.block_pool
    holders = _holders(tables)
    optional = _holders(maybe or {})
    free = {block.block_id for block in pool.free_block_queue.get_all_free_blocks()}
    for block, requests in sorted(holders.items()):
        count = pool.blocks[block].ref_cnt
        most = len(requests) + len(optional.get(block, ()))
        if block in free or not len(requests) <= count <= most:
            where = "is in the free queue" if block in free else f"has ref_cnt {count}"
            expected = f"{len(requests)}" if most == len(requests) else f"{len(requests)} to {most}"
            # a count above the tables': vLLM's own tables name who else holds the block
            others = [] if count <= most else _owners(scheduler, [block], {*requests, *optional.get(block, ())})
            raise SchedulerViolation(
                Check.ACCOUNTING,
                step,
                requests[0],
                f"block {block} is held by the tables of {len(requests)} running request(s) {requests} "
                f"(expected ref_cnt {expected}, not free), but the manager's block {where}"
                + "".join(f"; {description}" for _, description in others),
                "a held block in the free queue"
                if block in free
                else WAITING_CAUSE
                if others and _all_waiting(others)
                else "a held block's ref_cnt",
            )
    for block, requests in sorted(optional.items()):
        count = pool.blocks[block].ref_cnt
        if block not in holders and count > len(requests):
            raise SchedulerViolation(
                Check.ACCOUNTING,
                step,
                requests[0],
                f"block {block} is held by no table entry a running request still needs, and by {len(requests)} "
                f"out-of-window entries {requests} at most, but the manager's block has ref_cnt {count}",
                "an out-of-window block's ref_cnt",
            )
    usable = len(pool.blocks) - 1  # the null block is never free nor held
    reported = pool.get_num_free_blocks()
    most_free = usable - len(holders)
    least_free = most_free - len(set(optional) - set(holders))
    if not least_free <= reported <= most_free:
        leaked = sorted(
            block.block_id
            for block in pool.blocks[1:]
            if block.block_id not in free and block.block_id not in holders and block.block_id not in optional
        )
        must = f"{most_free}" if least_free == most_free else f"{least_free} to {most_free}"
        owners = _owners(scheduler, leaked)
        raise SchedulerViolation(
            Check.ACCOUNTING,
            step,
            owners[0][0] if owners else None,
            f"the manager reports {reported} free blocks, but the running requests' tables hold {len(holders)} "
            f"distinct blocks of {usable}, so {must} must be free; blocks neither free nor in a table: {leaked}"
            + "".join(f"; {description}" for _, description in owners),
            WAITING_CAUSE if owners and _all_waiting(owners) else "the free count",
        )


def _all_waiting(owners: list[tuple[str, str]]) -> bool:
    """Whether every one of ``owners`` (:func:`_owners`) is in vLLM's waiting queue, for requests holding no blocks."""
    return all(WAITING_QUEUE in description for _, description in owners)


def _queue_of(scheduler: Any, request: Any) -> str:
    """Which of vLLM's queues holds ``request``, for a message."""
    queues = {
        "running": "vLLM's running queue",
        "kv_holding_waiting": "vLLM's kv_holding_waiting queue (waiting with blocks)",
        "waiting": f"{WAITING_QUEUE} by vLLM's _holds_kv_blocks",
    }
    for name, described in queues.items():
        if any(queued is request for queued in getattr(scheduler, name, ())):
            return described
    return "none of vLLM's queues"


def _owners(scheduler: Any, blocks: list[int], known: Collection[str] = ()) -> list[tuple[str, str]]:
    """The requests other than ``known`` that vLLM's own tables (the manager's, per request) hold any of ``blocks``
    for, each with a description for the message: where a block neither free nor in a worker's table went."""
    wanted = set(blocks)
    owners: list[tuple[str, str]] = []
    for request_id, request in sorted(scheduler.requests.items()):
        if request_id in known:
            continue
        groups = scheduler.kv_cache_manager.coordinator.get_blocks(request_id)
        mine = sorted(wanted.intersection(block.block_id for group in groups for block in group))
        if mine:
            where = _queue_of(scheduler, request)
            owners.append(
                (
                    request_id,
                    f"{'block' if len(mine) == 1 else 'blocks'} {', '.join(map(str, mine))} in vLLM's own table for "
                    f"{request_id} ({request.status.name}, {request.num_computed_tokens} computed, in {where})",
                )
            )
    return owners
