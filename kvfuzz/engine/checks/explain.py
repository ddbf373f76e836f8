"""How a violation explains itself: where a position lives (sequence, logical block, physical block, slot), what K/V
a prefix expects, what a slot holds, and the root cause when two prefixes were given one block. A block's history
(its story) is kept by :class:`~kvfuzz.engine.pools.KVPools`."""

from __future__ import annotations

from typing import Optional

from kvfuzz.allocator.types import Namespace
from kvfuzz.engine.expected import ExpectedState
from kvfuzz.engine.groups import group_of, shown_namespace
from kvfuzz.engine.pools import UNTIL_LOADS_LAND, KVPools, SlotWrite


def where(state: ExpectedState, seq: str, position: int) -> str:
    h = state
    layout = h.layout(seq)
    index, offset = divmod(position, layout.size)
    block = h.seqs[seq].table[index]
    return (
        f"{h.label(seq)} position {position} -> logical block {index} -> physical block {block} "
        f"offset {offset} (slot {layout.slot(block, offset)})"
    )


def prefix(state: ExpectedState, seq: str, position: int) -> str:
    tokens = state.reference.tokens(seq)[: position + 1]
    return f"namespace {shown_namespace(state.reference.namespace(seq))}, tokens {tokens}"


def found(record: Optional[SlotWrite]) -> str:
    return "nothing: no write or copy has put K/V in this slot" if record is None else record.describe()


def open_window(pools: KVPools, block: int) -> Optional[str]:
    """Why ``block``'s in-flight window is still open (work issued before its release may land on it, or the
    allocator may hold it pending), or None when it is closed: what the pools' records of late work and holds know."""
    work = pools.late_work_by_block.get(block)
    if work is not None and work.lands_at == UNTIL_LOADS_LAND:
        return (
            f"released by {work.released_by} while step {work.released_at} was being scheduled, with a host-tier "
            "load into it not yet reported landed"
        )
    if work is not None:
        return (
            f"released by {work.released_by} while step {work.released_at} was being scheduled; with "
            f"W = {pools.inflight_window}, its in-flight window lasts until step {work.lands_at} completes"
        )
    until = pools.held_until.get(block)
    if until is not None:
        ends = "an asynchronous load lands" if until == UNTIL_LOADS_LAND else f"step {until} completes"
        return f"released, and the allocator may hold it pending until {ends}"
    return None


def shown_content(prefix: tuple[Namespace, tuple[int, ...]]) -> str:
    return f"namespace {shown_namespace(prefix[0])}, tokens {list(prefix[1])}"


def block_content(state: ExpectedState, seq: str, index: int) -> tuple[Namespace, tuple[int, ...]]:
    """``seq``'s namespace and tokens up to the end of its logical block ``index`` (or its last token)."""
    reference, end = state.reference, state.layout(seq).first_position(index + 1)
    return reference.namespace(seq), tuple(reference.tokens(seq)[:end])


def why_alike(
    mine: tuple[Namespace, tuple[int, ...]], theirs: tuple[Namespace, tuple[int, ...]], block_start: int = -1
) -> str:
    """What two different prefixes that were given one block have in common: the likely flaw of the key, or, when
    they agree on every position before one inside the block (``block_start``: the block's first position), a
    block written in place past what its cache entry covered."""
    if len(mine[1]) != len(theirs[1]):
        return (
            "they sit at different positions: the block was shared across logical blocks (handed out while still "
            "held, or matched by a cache key that named a block at another position: a hash collision, or a key "
            "that leaves out the blocks before it, trusted without comparing the tokens)"
        )
    if mine[1] == theirs[1] and group_of(mine[0]) != group_of(theirs[0]):
        return (
            "the prefixes differ only in their KV-cache group: the block holds another group's layers' K/V (a "
            "group mixed up in a table, or a cache key that leaves the group out)"
        )
    if mine[1] == theirs[1]:
        return (
            "the prefixes differ only in their namespace: the cache key leaves the namespace out, or joins its "
            "parts so that different namespaces read alike"
        )
    differ = next(position for position, (a, b) in enumerate(zip(mine[1], theirs[1])) if a != b)
    if mine[0] == theirs[0] and 0 <= block_start < differ:
        return (
            f"the prefixes agree up to position {differ - 1}, inside the block, and differ from position {differ} "
            "on: the block was written in place past what its cache entry covered (a write after a rollback, or "
            "into a block still cached), or the allocator keyed them alike and trusted the key without comparing "
            "the tokens"
        )
    return (
        "the prefixes differ in their tokens: the allocator keyed them alike, a hash collision (or a key that "
        "leaves tokens out) trusted without comparing the tokens"
    )


def root_cause(state: ExpectedState, seq: str, position: int, slot: int, record: Optional[SlotWrite]) -> list[str]:
    """Why ``seq``'s ``position`` in ``slot`` holds another prefix's K/V, when the block's other holders, or the
    write the slot holds, show two different prefixes given one block: both expected contents, and what they
    have in common."""
    h = state
    block, offset = divmod(slot, h.rows)
    tag = h.reference.tags(seq)[position]
    index = h.layout(seq).index(position)
    block_start = h.layout(seq).first_position(index)
    mine = block_content(state, seq, index)
    others = []
    for holder, index in sorted(h.refs.holders.get(block, ())):
        theirs_at = h.layout(holder).first_position(index) + offset
        if holder != seq and theirs_at < h.length(holder) and h.reference.tags(holder)[theirs_at] != tag:
            others.append((holder, block_content(state, holder, index)))
    if others:
        names = " and ".join(holder for holder, _ in others[:2])
        return [
            f"root cause: two holders of block {block} expect different K/V in it ({seq} and {names}), as when "
            "one cache entry serves two prefixes:",
            f"  {seq} expects {shown_content(mine)}",
            *(f"  {holder} expects {shown_content(theirs)}" for holder, theirs in others[:2]),
            f"  {why_alike(mine, others[0][1], block_start)}",
        ]
    if record is None or record.tag == tag:
        return []
    written = h.prefix_written(record.seq, record.position, record.tag)
    if written is None:
        return []
    mine = (mine[0], mine[1][: position + 1])
    return [
        f"root cause: block {block} holds K/V written for another prefix than the one {seq} expects there:",
        f"  {seq} expects {shown_content(mine)}",
        f"  {record.seq} wrote {shown_content(written)}",
        f"  {why_alike(mine, written, block_start)}, or the block was reused while a cache entry still named it "
        "(see its history)",
    ]
