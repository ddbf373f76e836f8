"""Eviction on request (``eviction``, ``targeted_eviction``): the engine asks the allocator to drop cached,
unreferenced blocks, by count (``evict``), all of them (``reset_cache``) or by id (``evict_blocks``). What it
dropped is checked against the cache before the call (invariant 4's counts, 13's order) and may not be matched
again until a table maps it anew (9).

The operations are functions of the engine core; :class:`kvfuzz.engine.Engine`'s methods of the same names and the
feature's rows of the operation table (:data:`ROWS`) call them.
"""

from __future__ import annotations

from typing import cast

from kvfuzz.allocator.protocol import Evicts, EvictsBlocks
from kvfuzz.engine.arguments import BlockIds, Integers
from kvfuzz.engine.core import EngineCore
from kvfuzz.engine.operation import Operation


def evict(core: EngineCore, num_blocks: int) -> None:
    """Drop up to ``num_blocks`` cached, unreferenced blocks (at least that many, or every cached one, under
    ``evict_rounds_up``)."""
    checks = core.checks
    core.begin("evict", num_blocks)
    introspection = checks.context.introspection
    before = list(introspection.cached_blocks()) if introspection is not None else []
    order_before = checks.eviction_order.snapshot()
    dropped = core.call(lambda: cast(Evicts, core.allocator).evict(num_blocks))
    checks.results.result(f"evict({num_blocks})", dropped, int)
    evicted = checks.context.evicted(before)
    checks.accounting.evict_count(num_blocks, dropped, before, evicted)
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
        checks.accounting.evict_targets(blocks, before, checks.context.evicted(before))
    core.evicted(blocks, f"evict_blocks({list(blocks)})")


def reset_cache(core: EngineCore) -> None:
    """Drop every cached, unreferenced block: none of the unreferenced blocks outside the in-flight window (and not
    held pending) may be matched again until a table maps it anew."""
    core.begin("reset_cache")
    core.call(cast(Evicts, core.allocator).reset_cache)
    core.checks.accounting.cache_empty()
    # A block in flight, or one the allocator may hold pending, may be cached again once released from that.
    held = core.pools.late_work_by_block.keys() | core.pools.held_until.keys()
    core.evicted([block for block in core.expected.refs.released if block not in held], "reset_cache()")


ROWS: tuple[Operation, ...] = (
    Operation(
        "evict",
        lambda engine, num_blocks: evict(engine, num_blocks),
        (("num_blocks", Integers(1, 4)),),
        needs=("eviction",),
        condition=lambda state: bool(state.finished),
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
        condition=lambda state: bool(state.finished),
        doc="drop every cached, unreferenced block",
    ),
)
"""The feature's rows of the operation table."""
