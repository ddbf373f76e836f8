"""Swapping (``swap``): a computed sequence's K/V moves to the host pool and back. The mapping each way is checked
against the table it moves (invariant 1), the host pool's accounting after each move (4), and the device blocks a
swap-in fills are the sequence's alone (5) and outside the in-flight window (6).

The operations are functions of the engine core; :meth:`kvfuzz.engine.Engine.swap_out`,
:meth:`~kvfuzz.engine.Engine.swap_in` and the ``swap_out`` and ``swap_in`` rows (:data:`ROWS`, its rows of the
operation table) call them.
"""

from __future__ import annotations

from typing import cast

from kvfuzz.allocator.protocol import Swaps
from kvfuzz.allocator.types import NULL_BLOCK, SeqId, SwapResult
from kvfuzz.engine.arguments import Pick
from kvfuzz.engine.core import EngineCore
from kvfuzz.engine.expected import Status, mapped
from kvfuzz.engine.operation import Operation


def swap_out(core: EngineCore, seq: SeqId) -> bool:
    """Move a running sequence's K/V to the host pool; returns whether the allocator found room there."""
    state, checks = core.expected, core.checks
    model = state.seqs[seq]
    core.begin("swap_out", seq)
    live = mapped(model.table)
    result = core.attempt(lambda: cast(Swaps, core.allocator).swap_out(seq), SwapResult, len(live), host=True)
    if result is None:
        return False
    held = state.host_holders()
    checks.content.swap_out_mapping(seq, result.mapping, model.table, held)
    shared = sum(host_block in held for _, host_block in result.mapping)
    if shared:
        core.stats["host blocks shared at swap-out"] += shared
    for block, host_block in result.mapping:
        core.pools.swap_to_host(block, host_block)
    host_of = dict(result.mapping)
    host_table = tuple(host_of.get(block, NULL_BLOCK) for block in model.table)
    change = core.set_table(seq, (), "released (swap-out) by")
    state.matchable.cancel(seq)
    model.status, model.host_table = Status.SWAPPED, host_table
    core.stats["swapped out blocks"] += len(live)
    core.settle(change)
    checks.accounting.host_accounting(host_of.values())
    return True


def swap_in(core: EngineCore, seq: SeqId) -> bool:
    """Bring a swapped-out sequence back to the device; returns whether the allocator found room."""
    state, checks = core.expected, core.checks
    model = state.seqs[seq]
    core.begin("swap_in", seq)
    before = checks.eviction_order.snapshot()
    result = core.attempt(lambda: cast(Swaps, core.allocator).swap_in(seq), SwapResult, len(mapped(model.host_table)))
    if result is None:
        return False
    checks.content.swap_in_mapping(seq, result.mapping, model.host_table)
    state.matchable.forget(block for _, block in result.mapping)
    for host_block, block in result.mapping:
        core.pools.swap_from_host(host_block, block)
    host_table = mapped(model.host_table)
    model.status, model.host_table, model.joined_step = Status.RUNNING, (), core.pools.next_step
    table = core.table(seq)
    change = core.set_table(seq, table, "swapped in for")
    core.settle(
        change, positions=[(seq, position) for position in range(state.sliding_window_start(seq), model.written)]
    )
    checks.eviction_order.evictions(before, (), reuse=True)
    for _, block in result.mapping:
        checks.exclusive.block(block, seq, "swap-in copy")
    checks.window.outside({block for _, block in result.mapping}, seq)
    checks.accounting.host_accounting(host_table, released_by=f"swap_in({seq!r})")
    core.stats["swapped in blocks"] += len(result.mapping)
    return True


ROWS: tuple[Operation, ...] = (
    Operation(
        "swap_out",
        lambda engine, seq: swap_out(engine, seq),
        (("seq", Pick(lambda state: state.computed_ids())),),
        needs=("swap",),
        condition=lambda state: state.num_host_blocks > 0,
        doc="move a computed sequence's K/V to the host pool",
    ),
    Operation(
        "swap_in",
        lambda engine, seq: swap_in(engine, seq),
        (("seq", Pick(lambda state: state.ids(Status.SWAPPED))),),
        needs=("swap",),
        doc="bring a swapped-out sequence back to the device",
    ),
)
"""The feature's rows of the operation table."""
