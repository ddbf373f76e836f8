"""Eviction on request (``eviction``, ``targeted_eviction``): the engine asks the allocator to drop cached,
unreferenced blocks, by count (``evict``), all of them (``reset_cache``) or by id (``evict_blocks``). What it
dropped is checked against the cache before the call (invariant 4's counts, 13's order) and may not be matched
again until a table maps it anew (9). The checks of invariant 4 that only these operations trigger are the
feature's own; the others are the invariants' checkers'.

The operations are functions of the engine core; :class:`kvfuzz.engine.Engine`'s methods of the same names and the
feature's rows of the operation table (:data:`ROWS`) call them.
"""

from __future__ import annotations

from typing import Sequence, cast

from kvfuzz.allocator.protocol import Evicts, EvictsBlocks
from kvfuzz.engine.arguments import BlockIds, Integers, finished_any
from kvfuzz.engine.checks import CheckContext
from kvfuzz.engine.core import EngineCore
from kvfuzz.engine.operation import Operation
from kvfuzz.engine.violations import Cause, Invariant


def evict(core: EngineCore, num_blocks: int) -> None:
    """Drop up to ``num_blocks`` cached, unreferenced blocks (at least that many, or every cached one, under
    ``evict_rounds_up``)."""
    checks = core.checks
    core.begin("evict", num_blocks)
    introspection = checks.context.introspection
    before = list(introspection.cached_blocks()) if introspection is not None else []
    order_before = checks.eviction_order.snapshot()
    dropped = core.call(lambda: cast(Evicts, core.allocator).evict(num_blocks))
    checks.results.result(dropped, int, f"evict({num_blocks})")
    evicted = checks.context.evicted(before)
    check_evict_count(checks.context, num_blocks, dropped, before, evicted)
    core.stats["evicted blocks"] += dropped
    core.evicted(evicted, f"evict({num_blocks})")
    checks.eviction_order.evictions(order_before, (), reuse=False)


def evict_blocks(core: EngineCore, blocks: tuple[int, ...]) -> None:
    """Drop these unreferenced blocks from the cache (those it caches; the others stay as they are): none may be
    matched again until a table maps it anew."""
    checks = core.checks
    core.begin("evict_blocks", list(blocks))
    introspection = checks.context.introspection
    before = list(introspection.cached_blocks()) if introspection is not None else []
    core.call(lambda: cast(EvictsBlocks, core.allocator).evict_blocks(blocks))
    if introspection is not None:
        check_evict_targets(checks.context, blocks, before, checks.context.evicted(before))
    core.evicted(blocks, f"evict_blocks({list(blocks)})")


def reset_cache(core: EngineCore) -> None:
    """Drop every cached, unreferenced block: none of the unreferenced blocks outside the in-flight window (and not
    held pending) may be matched again until a table maps it anew."""
    core.begin("reset_cache")
    core.call(cast(Evicts, core.allocator).reset_cache)
    check_cache_empty(core.checks.context)
    # A block in flight, or one the allocator may hold pending, may be cached again once released from that.
    held = core.pools.late_work_by_block.keys() | core.pools.held_until.keys()
    core.evicted([block for block in core.expected.refs.released if block not in held], "reset_cache()")


def check_evict_count(
    context: CheckContext, num_blocks: int, dropped: int, before: Sequence[int], evicted: Sequence[int]
) -> None:
    """Invariant 4: evict(n) reports between 0 and n blocks dropped (under ``evict_rounds_up``: at least n, or
    every cached block), and, with introspection, exactly the number that left the cached set."""
    rounds_up = context.state.caps.evict_rounds_up
    if dropped < 0 or (not rounds_up and dropped > num_blocks):
        context.fail(
            Invariant.FREE_SET,
            f"evict({num_blocks}) reports {dropped} blocks dropped",
            [f"expected: between 0 and {num_blocks}" if not rounds_up else "expected: a count of blocks, >= 0"],
            Cause("evict reported a count of dropped blocks out of range"),
        )
    if context.introspection is None:
        return
    if dropped != len(evicted):
        context.fail(
            Invariant.FREE_SET,
            f"evict({num_blocks}) reports {dropped} blocks dropped, but {len(evicted)} left the cached set",
            [f"left the cached set: {sorted(evicted)}", f"cached before: {sorted(before)}"],
            Cause("evict reported a count unlike the blocks that left the cached set"),
        )
    least = min(num_blocks, len(before))
    if rounds_up and len(evicted) < least:
        context.fail(
            Invariant.FREE_SET,
            f"evict({num_blocks}) dropped {len(evicted)} block(s) while {len(before)} were cached",
            [
                f"expected: at least {least}: evict_rounds_up drops whole cached subtrees until at least "
                f"{num_blocks} blocks are gone, or every cached block",
                f"found:    dropped {sorted(evicted)}; still cached: {sorted(set(before) - set(evicted))}",
            ],
            Cause("evict dropped fewer blocks than evict_rounds_up requires"),
        )


def check_evict_targets(
    context: CheckContext, targets: Sequence[int], before: Sequence[int], evicted: Sequence[int]
) -> None:
    """Invariant 4: evict_blocks drops exactly the named blocks that were cached, and nothing else."""
    cached_before = set(before)
    kept = [block for block in targets if block in cached_before and block not in evicted]
    unnamed = [block for block in evicted if block not in targets]
    if kept or unnamed:
        context.fail(
            Invariant.FREE_SET,
            f"evict_blocks({list(targets)}) "
            + (f"left block(s) {kept} cached" if kept else f"dropped block(s) {unnamed} it was not given"),
            [
                f"expected: exactly the named blocks that were cached dropped: {sorted(cached_before & set(targets))}",
                f"found:    dropped {sorted(evicted)}",
                *context.pools.block_story((kept or unnamed)[0]),
            ],
            Cause(
                "evict_blocks left a named cached block cached"
                if kept
                else "evict_blocks dropped a block it was not given"
            ),
        )


def check_cache_empty(context: CheckContext) -> None:
    """Invariant 4: after reset_cache no cached, unreferenced block is left."""
    if context.introspection is not None and len(context.introspection.cached_blocks()):
        context.fail(
            Invariant.FREE_SET,
            f"reset_cache left {len(context.introspection.cached_blocks())} cached unreferenced block(s)",
            ["expected: none"],
            Cause("reset_cache left cached blocks"),
        )


ROWS: tuple[Operation, ...] = (
    Operation(
        "evict",
        lambda engine, num_blocks: evict(engine, num_blocks),
        (("num_blocks", Integers(1, 4)),),
        needs=("eviction",),
        condition=finished_any,
        doc="drop up to that many cached, unreferenced blocks",
    ),
    Operation(
        "evict_blocks",
        lambda engine, blocks: evict_blocks(engine, tuple(blocks)),
        (("blocks", BlockIds(lambda state: state.released_blocks())),),
        needs=("targeted_eviction",),
        doc="drop particular blocks from the cache by id (a KV connector's or an offloader's eviction): picked "
        "among the blocks some sequence released, cached or not",
    ),
    Operation(
        "reset_cache",
        lambda engine: reset_cache(engine),
        needs=("eviction",),
        condition=finished_any,
        doc="drop every cached, unreferenced block",
    ),
)
"""The feature's rows of the operation table."""
