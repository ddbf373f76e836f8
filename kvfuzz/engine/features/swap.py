"""Swapping (``swap``): a computed sequence's K/V moves to the host pool and back. The mapping each way is checked
against the table it moves (invariant 1), the host pool's accounting after each move (4), and the device blocks a
swap-in fills are the sequence's alone (5) and outside the in-flight window (6). The mapping checks are the
feature's own (only a swap triggers them); the others are the invariants' checkers'.

The operations are functions of the engine core; :meth:`kvfuzz.engine.Engine.swap_out`,
:meth:`~kvfuzz.engine.Engine.swap_in` and the ``swap_out`` and ``swap_in`` rows (:data:`ROWS`, its rows of the
operation table) call them.
"""

from __future__ import annotations

from typing import Mapping, Sequence, cast

from kvfuzz.allocator.protocol import Swaps
from kvfuzz.allocator.types import NULL_BLOCK, SeqId, SwapResult
from kvfuzz.engine.arguments import Pick, computed
from kvfuzz.engine.checks import CheckContext
from kvfuzz.engine.checks.explain import prefix
from kvfuzz.engine.core import EngineCore
from kvfuzz.engine.expected import Status, mapped
from kvfuzz.engine.operation import Operation
from kvfuzz.engine.violations import Cause, Invariant


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
    check_swap_out_mapping(checks.context, seq, result.mapping, model.table, held)
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
    check_swap_in_mapping(checks.context, seq, result.mapping, model.host_table)
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


def check_swap_out_mapping(
    context: CheckContext,
    seq: str,
    mapping: Sequence[tuple[int, int]],
    table: tuple[int, ...],
    host_holders: Mapping[int, Sequence[tuple[str, int]]],
) -> None:
    """Invariant 1: swap-out copies every block of the table once, to distinct host blocks that no other
    swapped-out sequence holds (``host_holders``), or under ``shares_host_blocks`` one that holds the same K/V."""
    host_of = dict(mapping)
    live = [block for block in table if block != NULL_BLOCK]
    if sorted(host_of) != sorted(live) or len(mapping) != len(live):
        context.fail(
            Invariant.CONTENT,
            f"swap-out of {seq} maps device blocks {sorted(host_of)}",
            [f"expected: the blocks of its table {list(table)}, each once"],
            Cause("a swap-out mapping that does not copy each block of the table once"),
        )
    clash = sorted(set(host_of.values()) & host_holders.keys())
    if len(set(host_of.values())) != len(host_of) or (clash and not context.state.caps.shares_host_blocks):
        context.fail(
            Invariant.CONTENT,
            f"swap-out of {seq} reuses host block(s) {clash or host_of}",
            ["expected: distinct host blocks no other swapped-out sequence holds"],
            Cause("a swap-out into a host block another swapped-out sequence holds"),
        )
    index_of = {block: index for index, block in enumerate(table) if block != NULL_BLOCK}
    for block, host_block in mapping:
        for holder, holder_index in host_holders.get(host_block, ()):
            _same_host_content(context, seq, index_of[block], block, host_block, holder, holder_index)


def _same_host_content(
    context: CheckContext, seq: str, index: int, block: int, host_block: int, holder: str, holder_index: int
) -> None:
    """Under ``shares_host_blocks``: ``seq``'s logical block ``index``, swapped out to ``host_block``, which
    ``holder`` holds as its logical block ``holder_index``, is full in both with the same K/V at the same index
    (same namespace and tokens up to its end: the same tags)."""
    h = context.state
    size = h.block_size
    lo, hi = index * size, (index + 1) * size
    mine, theirs = h.reference.tags(seq), h.reference.tags(holder)
    if index == holder_index and hi <= min(len(mine), len(theirs)) and mine[lo:hi] == theirs[lo:hi]:
        return
    if index != holder_index:
        found = f"found:    {holder} holds it as its logical block {holder_index}, not {index}"
    elif hi > min(len(mine), len(theirs)):
        short = seq if len(mine) < hi else holder
        found = f"found:    {short}'s logical block {index} is not full ({len(h.reference.tags(short)) - lo} tokens)"
    else:
        position = next(p for p in range(lo, hi) if mine[p] != theirs[p])
        found = (
            f"found:    position {position} differs: {seq} holds {prefix(context.state, seq, position)}, "
            f"{holder} holds {prefix(context.state, holder, position)}"
        )
    context.fail(
        Invariant.CONTENT,
        f"swap-out of {seq} maps its logical block {index} (block {block}) to host block {host_block}, which "
        f"swapped-out {holder} holds with other K/V",
        [
            "expected: a host block another swapped-out sequence holds only with the same K/V (shares_host_blocks):"
            " the same full logical block, namespace and tokens up to its end",
            found,
            *context.pools.block_story(block),
        ],
        Cause("a swap-out sharing a host block that holds other K/V"),
    )


def check_swap_in_mapping(
    context: CheckContext, seq: str, mapping: Sequence[tuple[int, int]], host_table: tuple[int, ...]
) -> None:
    """Invariant 1: swap-in copies back exactly the host blocks the sequence was swapped out to."""
    sources = sorted(src for src, _ in mapping)
    if sources != sorted(block for block in host_table if block != NULL_BLOCK):
        context.fail(
            Invariant.CONTENT,
            f"swap-in of {seq} copies host blocks {sources}",
            [f"expected: the host blocks it was swapped out to, {list(host_table)}"],
            Cause("a swap-in that copies other host blocks than its swap-out filled"),
        )


ROWS: tuple[Operation, ...] = (
    Operation(
        "swap_out",
        lambda engine, seq: swap_out(engine, seq),
        (("seq", Pick(computed)),),
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
