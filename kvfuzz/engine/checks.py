"""The invariant checks, run after every operation on what that operation changed (never the whole pool).

Each check raises :class:`InvariantViolation` with the sequence, position, block and slot involved, what was
expected, what was found, and where what was found came from.
"""

from __future__ import annotations

import collections.abc
import functools
import itertools
from typing import Collection, Iterable, Mapping, NoReturn, Optional, Sequence, cast

import attrs
import torch

from kvfuzz.allocator.errors import AllocatorError, Misuse, OutOfBlocks
from kvfuzz.allocator.protocol import AllocatorProtocol, GroupedTables, HostIntrospectable, Introspectable
from kvfuzz.allocator.types import (
    NULL_BLOCK,
    AdmitResult,
    BlockCopy,
    GrowResult,
    HostTransfers,
    Namespace,
    Slot,
    SwapResult,
)
from kvfuzz.engine.expected import ExpectedState, Status
from kvfuzz.engine.groups import group_of, shown_namespace
from kvfuzz.engine.misuse import MisuseCall
from kvfuzz.engine.pools import UNTIL_LOADS_LAND, KVPools, SlotWrite
from kvfuzz.engine.violations import Invariant, violation
from kvfuzz.kernels import AttentionKernel, PagedBatch, compare, make_kernel
from kvfuzz.reference.content import kv_for_tags


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: object) -> str:
    text = repr(value)
    return f"{text if len(text) <= 80 else text[:77] + '...'} ({type(value).__name__})"


_RESULT_SHAPES = {
    AdmitResult: "(block_table=[int, ...], num_cached_tokens=int, loads=[(int, int), ...])",
    HostTransfers: "(stores=[(int, int), ...], flushed=[(int, int), ...])",
    GrowResult: "(slots=[Slot(block=int, offset=int), ...], copies=[BlockCopy(src=int, dst=int), ...])",
    SwapResult: "(mapping=[(int, int), ...])",
    int: "",
    tuple: " of BlockCopy(src=int, dst=int), or None",
}


def _malformed(result: object, expected: type) -> Optional[str]:
    """What is wrong with ``result`` as a value of ``expected`` (a fork's copies are checked as a tuple), or None."""
    if expected is int:
        return None if _is_int(result) else _shown(result)
    if expected is tuple:
        items: Sequence[object] = result if isinstance(result, tuple) else ()
        if not isinstance(result, tuple) or not all(isinstance(copy, BlockCopy) for copy in items):
            return _shown(result)
        numbers = [number for copy in result for number in (copy.src, copy.dst)]
    elif not isinstance(result, expected):
        return _shown(result)
    elif isinstance(result, AdmitResult):
        numbers = [*result.block_table, result.num_cached_tokens, *(n for pair in result.loads for n in pair)]
    elif isinstance(result, HostTransfers):
        numbers = [n for pair in (*result.stores, *result.flushed) for n in pair]
    elif isinstance(result, GrowResult):
        if not all(isinstance(slot, Slot) for slot in result.slots):
            return f"slots {list(result.slots)}"
        if not all(isinstance(copy, BlockCopy) for copy in result.copies):
            return f"copies {list(result.copies)}"
        numbers = [n for slot in result.slots for n in (slot.block, slot.offset)]
        numbers += [n for copy in result.copies for n in (copy.src, copy.dst)]
    elif isinstance(result, SwapResult):
        pairs = list(result.mapping)
        if not all(isinstance(pair, tuple) and len(pair) == 2 for pair in pairs):
            return f"mapping {pairs}"
        numbers = [n for pair in pairs for n in pair]
    else:
        numbers = []
    bad = [number for number in numbers if not _is_int(number)]
    return None if not bad else f"{_shown(result)}: {_shown(bad[0])} where an int belongs"


@attrs.frozen
class CacheSnapshot:
    """The allocator's cached and free blocks before an operation, and every unreferenced block in the order it was
    released (the engine's own record, tail blocks of one release first): what the eviction-order check compares
    the operation's evictions against."""

    cached: tuple[int, ...]  # cached blocks, in the allocator's order
    free: frozenset[int]  # free blocks
    recency: tuple[int, ...]  # unreferenced blocks, least recently released first


@attrs.frozen
class PoolCounts:
    """Sizes of the allocator's free, cached (evictable) and pending sets."""

    free: int  # device blocks free
    cached: int  # device blocks cached and unreferenced
    pending: int  # device blocks inside the in-flight window
    host_free: Optional[int] = None  # host blocks free, where the allocator exposes its host free set


class Checks:
    """Every invariant check, over one allocator, the engine's K/V pools and its expected state. Every invariant
    failure is raised from here, labelled with the operation the engine is performing (``operation``)."""

    def __init__(self, state: ExpectedState, pools: KVPools, allocator: AllocatorProtocol, kernel_name: str) -> None:
        self.state = state  # what the engine expects of the allocator
        self.pools = pools  # the K/V the engine wrote, and who wrote each slot
        self.allocator = allocator  # the allocator under test
        # Its optional queries, when it declares them (kvfuzz.allocator.protocol.Introspectable).
        self.introspection: Optional[Introspectable] = (
            cast(Introspectable, allocator) if state.caps.introspection else None
        )
        # Its host free set, when it has a host pool and implements the query (HostIntrospectable).
        self.host_introspection: Optional[HostIntrospectable] = (
            allocator
            if state.caps.introspection and state.num_host_blocks and isinstance(allocator, HostIntrospectable)
            else None
        )
        self.kernel_name = kernel_name  # invariant 2's attention kernel
        self.operation = "setup"  # the operation being checked, as a call a person can read

    def fail(self, invariant: Invariant, summary: str, details: Iterable[str] = ()) -> NoReturn:
        raise violation(invariant, self.operation, self.pools.next_step, summary, list(details))

    # -- describing things ---------------------------------------------------------------------------------------

    def where(self, seq: str, position: int) -> str:
        h = self.state
        layout = h.layout(seq)
        index, offset = divmod(position, layout.size)
        block = h.seqs[seq].table[index]
        return (
            f"{h.label(seq)} position {position} -> logical block {index} -> physical block {block} "
            f"offset {offset} (slot {layout.slot(block, offset)})"
        )

    def prefix(self, seq: str, position: int) -> str:
        tokens = self.state.reference.tokens(seq)[: position + 1]
        return f"namespace {shown_namespace(self.state.reference.namespace(seq))}, tokens {tokens}"

    @staticmethod
    def found(record: Optional[SlotWrite]) -> str:
        return "nothing: no write or copy has put K/V in this slot" if record is None else record.describe()

    @staticmethod
    def _content(prefix: tuple[Namespace, tuple[int, ...]]) -> str:
        return f"namespace {shown_namespace(prefix[0])}, tokens {list(prefix[1])}"

    def _block_content(self, seq: str, index: int) -> tuple[Namespace, tuple[int, ...]]:
        """``seq``'s namespace and tokens up to the end of its logical block ``index`` (or its last token)."""
        reference, end = self.state.reference, self.state.layout(seq).first_position(index + 1)
        return reference.namespace(seq), tuple(reference.tokens(seq)[:end])

    @staticmethod
    def _why_alike(mine: tuple[Namespace, tuple[int, ...]], theirs: tuple[Namespace, tuple[int, ...]]) -> str:
        """What two different prefixes that were given one block have in common: the likely flaw of the key."""
        if len(mine[1]) != len(theirs[1]):
            return "they sit at different positions: the block was shared across logical blocks"
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
        return (
            "the prefixes differ in their tokens: the allocator keyed them alike, a hash collision (or a key that "
            "leaves tokens out) trusted without comparing the tokens"
        )

    def root_cause(self, seq: str, position: int, slot: int, record: Optional[SlotWrite]) -> list[str]:
        """Why ``seq``'s ``position`` in ``slot`` holds another prefix's K/V, when the block's other holders, or the
        write the slot holds, show two different prefixes given one block: both expected contents, and what they
        have in common."""
        h = self.state
        block, offset = divmod(slot, h.rows)
        tag = h.reference.tags(seq)[position]
        mine = self._block_content(seq, h.layout(seq).index(position))
        others = []
        for holder, index in sorted(h.refs.holders.get(block, ())):
            theirs_at = h.layout(holder).first_position(index) + offset
            if holder != seq and theirs_at < h.length(holder) and h.reference.tags(holder)[theirs_at] != tag:
                others.append((holder, self._block_content(holder, index)))
        if others:
            names = " and ".join(holder for holder, _ in others[:2])
            return [
                f"root cause: two holders of block {block} expect different K/V in it ({seq} and {names}), as when "
                "one cache entry serves two prefixes:",
                f"  {seq} expects {self._content(mine)}",
                *(f"  {holder} expects {self._content(theirs)}" for holder, theirs in others[:2]),
                f"  {self._why_alike(mine, others[0][1])}",
            ]
        if record is None or record.tag == tag:
            return []
        written = h.prefix_written(record.seq, record.position, record.tag)
        if written is None:
            return []
        mine = (mine[0], mine[1][: position + 1])
        return [
            f"root cause: block {block} holds K/V written for another prefix than the one {seq} expects there:",
            f"  {seq} expects {self._content(mine)}",
            f"  {record.seq} wrote {self._content(written)}",
            f"  {self._why_alike(mine, written)}, or the block was reused while a cache entry still named it (see "
            "its history)",
        ]

    # -- invariant 1: content ------------------------------------------------------------------------------------

    def content(self, slots: Iterable[int], positions: Iterable[tuple[str, int]] = ()) -> None:
        """Every written position mapped to one of ``slots``, and every listed position, holds its own K/V."""
        h = self.state
        wanted: dict[tuple[str, int], int] = {}
        by_block: dict[int, list[int]] = {}
        for slot in slots:
            by_block.setdefault(slot // h.rows, []).append(slot % h.rows)
        for block, offsets in by_block.items():
            for seq, index in h.refs.holders.get(block, ()):
                written, layout = h.seqs[seq].written, h.layout(seq)
                for offset in offsets:
                    position = layout.first_position(index) + offset
                    if offset < layout.size and position < written:
                        wanted[(seq, position)] = layout.slot(block, offset)
        for seq, position in positions:
            if position < h.sliding_window_start(seq):
                continue
            wanted[(seq, position)] = h.layout(seq).slot_of(h.seqs[seq].table, position)
        if not wanted:
            return
        expected_tags = []
        for (seq, position), slot in wanted.items():
            tag = h.reference.tags(seq)[position]
            record = self.pools.record(slot)
            if record is None or record.tag != tag:
                self.fail(
                    Invariant.CONTENT,
                    f"{self.where(seq, position)} holds another prefix's K/V",
                    [
                        f"expected: K/V of {self.prefix(seq, position)}",
                        f"found:    {self.found(record)}",
                        *self.root_cause(seq, position, slot, record),
                        *self.pools.block_story(slot // h.rows),
                    ],
                )
            expected_tags.append(tag)
        self._bits(list(wanted.items()), expected_tags)

    def _bits(self, entries: list[tuple[tuple[str, int], int]], tags: list[int]) -> None:
        """The pool's values equal the reference's bit for bit (the shadow records already agree)."""
        keys, values = self.pools.rows(slot for _, slot in entries)
        want_keys, want_values = kv_for_tags(tags, self.pools.shape)
        if torch.equal(keys, want_keys) and torch.equal(values, want_values):
            return
        rows = ((keys != want_keys) | (values != want_values)).flatten(1).any(1).nonzero().flatten().tolist()
        (seq, position), slot = entries[rows[0]]
        self.fail(
            Invariant.CONTENT,
            f"{self.where(seq, position)}: shadow record is right but the values differ",
            [
                f"expected: K/V of {self.prefix(seq, position)}",
                f"found:    values that differ in {len(rows)} checked position(s); the record says "
                f"{self.found(self.pools.record(slot))}",
            ],
        )

    def table_shape(self, seq: str, table: tuple[int, ...]) -> None:
        h = self.state
        want, lookahead = h.num_blocks_for(seq), h.caps.lookahead_blocks
        if not want <= len(table) <= want + lookahead:
            self.fail(
                Invariant.REFCOUNTS,
                f"block table of {seq} holds {len(table)} block(s) for {len(h.reference.tokens(seq))} tokens",
                [
                    f"expected: exactly {want} block(s) of {h.layout(seq).size} slots"
                    if not lookahead
                    else f"expected: {want} block(s) of {h.layout(seq).size} slots, then at most {lookahead} "
                    "look-ahead "
                    f"block(s) (lookahead_blocks = {lookahead})",
                    f"found:    {list(table)}",
                ],
            )
        bad = [block for block in table if not 0 <= block < h.num_blocks and block != NULL_BLOCK]
        if bad:
            self.fail(
                Invariant.REFCOUNTS,
                f"block table of {seq} names block(s) {bad} outside the pool",
                [f"expected: blocks in 0..{h.num_blocks - 1}", f"found:    {list(table)}"],
            )
        first_read = h.layout(seq).index(h.sliding_window_start(seq))
        if NULL_BLOCK in table[first_read:]:
            index = table.index(NULL_BLOCK, first_read)
            self.fail(
                Invariant.CONTENT,
                f"block table of {seq} drops logical block {index}, which attention still reads",
                [
                    f"expected: blocks covering positions {h.sliding_window_start(seq)} onwards "
                    f"(sliding window {h.window(seq)})",
                    f"found:    {list(table)}",
                ],
            )

    # -- invariant 12: well-formed results ---------------------------------------------------------------------

    def result(self, operation: str, result: object, expected: type) -> None:
        """Invariant 12: an operation returned the contract's result type, with integer block ids and counts.

        ``None`` in particular is never a refusal (a refusal raises ``OutOfBlocks``), so it is not counted as one."""
        problem = _malformed(result, expected)
        if problem is not None:
            self.fail(
                Invariant.RESULTS,
                f"{operation} returned {_shown(result)}",
                [
                    f"expected: {expected.__name__}{_RESULT_SHAPES.get(expected, '')}; a refusal raises "
                    "kvfuzz.allocator.errors.OutOfBlocks",
                    f"found:    {problem}",
                ],
            )

    def block_table(self, seq: str, table: object) -> tuple[int, ...]:
        """Invariant 12: ``block_table(seq)`` returned a sequence of int block ids (NULL_BLOCK for a dropped block);
        returns it as a tuple."""
        if not isinstance(table, collections.abc.Sequence) or isinstance(table, (str, bytes)):
            self.fail(
                Invariant.RESULTS,
                f"block_table({seq!r}) returned {_shown(table)}",
                ["expected: a sequence of int block ids", f"found:    {_shown(table)}"],
            )
        blocks = tuple(table)
        bad = [block for block in blocks if not _is_int(block)]
        if bad:
            self.fail(
                Invariant.RESULTS,
                f"block_table({seq!r}) lists {_shown(bad[0])}",
                ["expected: block ids as int", f"found:    {[_shown(block) for block in blocks]}"],
            )
        return blocks

    def allocator_table(self, seq: str) -> tuple[int, ...]:
        """The allocator's current table of ``seq``, or of a group table its owner's ``group_block_tables`` entry
        (unchecked: for comparing with what the engine recorded)."""
        model = self.state.seqs[seq]
        if not model.owner:
            return tuple(self.allocator.block_table(seq))
        return tuple(cast(GroupedTables, self.allocator).group_block_tables(model.owner)[model.group])

    def admit_table(self, seq: str, reported: tuple[int, ...], table: tuple[int, ...]) -> None:
        """Invariant 1: the table admit returned is the one ``block_table`` reports."""
        if table != reported:
            self.fail(
                Invariant.CONTENT,
                f"admit returned block table {list(reported)} for {seq}",
                [f"found: block_table({seq!r}) says {list(table)}"],
            )

    def grow_slots(self, seq: str, slots: Sequence[Slot], table: tuple[int, ...], old_len: int, count: int) -> None:
        """Invariant 1: grow returned one slot per token, each where the block table puts that position."""
        size = self.state.layout(seq).size
        for position, slot in enumerate(slots, start=old_len):
            want = (table[position // size], position % size)
            if (slot.block, slot.offset) != want:
                self.fail(
                    Invariant.CONTENT,
                    f"grow returned slot (block {slot.block}, offset {slot.offset}) for {seq} position {position}",
                    [f"expected: (block {want[0]}, offset {want[1]}) as its block table says: {list(table)}"],
                )
        if len(slots) != count:
            self.fail(Invariant.CONTENT, f"grow of {count} tokens returned {len(slots)} slots")

    def swap_out_mapping(
        self,
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
            self.fail(
                Invariant.CONTENT,
                f"swap-out of {seq} maps device blocks {sorted(host_of)}",
                [f"expected: the blocks of its table {list(table)}, each once"],
            )
        clash = sorted(set(host_of.values()) & host_holders.keys())
        if len(set(host_of.values())) != len(host_of) or (clash and not self.state.caps.shares_host_blocks):
            self.fail(
                Invariant.CONTENT,
                f"swap-out of {seq} reuses host block(s) {clash or host_of}",
                ["expected: distinct host blocks no other swapped-out sequence holds"],
            )
        index_of = {block: index for index, block in enumerate(table) if block != NULL_BLOCK}
        for block, host_block in mapping:
            for holder, holder_index in host_holders.get(host_block, ()):
                self._same_host_content(seq, index_of[block], block, host_block, holder, holder_index)

    def _same_host_content(
        self, seq: str, index: int, block: int, host_block: int, holder: str, holder_index: int
    ) -> None:
        """Under ``shares_host_blocks``: ``seq``'s logical block ``index``, swapped out to ``host_block``, which
        ``holder`` holds as its logical block ``holder_index``, is full in both with the same K/V at the same index
        (same namespace and tokens up to its end: the same tags)."""
        h = self.state
        size = h.block_size
        lo, hi = index * size, (index + 1) * size
        mine, theirs = h.reference.tags(seq), h.reference.tags(holder)
        if index == holder_index and hi <= min(len(mine), len(theirs)) and mine[lo:hi] == theirs[lo:hi]:
            return
        if index != holder_index:
            found = f"found:    {holder} holds it as its logical block {holder_index}, not {index}"
        elif hi > min(len(mine), len(theirs)):
            short = seq if len(mine) < hi else holder
            found = (
                f"found:    {short}'s logical block {index} is not full ({len(h.reference.tags(short)) - lo} tokens)"
            )
        else:
            position = next(p for p in range(lo, hi) if mine[p] != theirs[p])
            found = (
                f"found:    position {position} differs: {seq} holds {self.prefix(seq, position)}, "
                f"{holder} holds {self.prefix(holder, position)}"
            )
        self.fail(
            Invariant.CONTENT,
            f"swap-out of {seq} maps its logical block {index} (block {block}) to host block {host_block}, which "
            f"swapped-out {holder} holds with other K/V",
            [
                "expected: a host block another swapped-out sequence holds only with the same K/V (shares_host_blocks):"
                " the same full logical block, namespace and tokens up to its end",
                found,
                *self.pools.block_story(block),
            ],
        )

    def swap_in_mapping(self, seq: str, mapping: Sequence[tuple[int, int]], host_table: tuple[int, ...]) -> None:
        """Invariant 1: swap-in copies back exactly the host blocks the sequence was swapped out to."""
        sources = sorted(src for src, _ in mapping)
        if sources != sorted(block for block in host_table if block != NULL_BLOCK):
            self.fail(
                Invariant.CONTENT,
                f"swap-in of {seq} copies host blocks {sources}",
                [f"expected: the host blocks it was swapped out to, {list(host_table)}"],
            )

    def host_loads(self, seq: str, loads: Sequence[tuple[int, int]], num_cached: int) -> None:
        """Invariants 9 and 5 for an admission's host-tier loads: only under ``host_cache``, from host blocks that
        exist, each into a distinct block of the sequence's cache hit that it alone references."""
        h = self.state
        table = h.seqs[seq].table
        hit_blocks = [block for block in table[: h.layout(seq).blocks_for(num_cached)] if block != NULL_BLOCK]
        if not h.caps.host_cache:
            self.fail(
                Invariant.CACHE_SOUNDNESS,
                f"admit of {seq} orders host-tier loads {list(loads)}",
                ["expected: none: the allocator does not declare host_cache"],
            )
        for host_block, block in loads:
            if not (_is_int(host_block) and 0 <= host_block < h.num_host_blocks) or block not in hit_blocks:
                self.fail(
                    Invariant.CACHE_SOUNDNESS,
                    f"admit of {seq} loads host block {_shown(host_block)} into block {_shown(block)}",
                    [
                        f"expected: a host block 0 .. {h.num_host_blocks - 1} loaded into one of the blocks its "
                        f"{num_cached}-token hit covers, {hit_blocks}",
                        *(self.pools.block_story(block) if _is_int(block) and block >= 0 else ()),
                    ],
                )
            self.exclusive(block, seq, f"host-tier load for {seq} from host block {host_block}")
        destinations = [block for _, block in loads]
        if len(set(destinations)) != len(destinations):
            self.fail(
                Invariant.CACHE_SOUNDNESS,
                f"admit of {seq} loads two host blocks into one device block: {list(loads)}",
                ["expected: each device block loaded once"],
            )

    def waits_for_loads(self, seq: str, result: AdmitResult) -> None:
        """An admission that waits for its loads: only under ``async_loads``, with loads to wait for."""
        h = self.state
        if not h.caps.async_loads:
            self.fail(
                Invariant.RESULTS,
                f"admit of {seq} waits for its loads",
                ["expected: an admission that does not wait: the allocator does not declare async_loads"],
            )
        if not result.loads:
            self.fail(
                Invariant.RESULTS,
                f"admit of {seq} waits for its loads but orders none",
                ["expected: host-tier loads to wait for (an admission with nothing to load does not wait)"],
            )

    def resumed_hit(self, seq: str, result: AdmitResult, covered: int) -> None:
        """``resume`` of a sequence whose loads landed reports the hit its admission reported, loads nothing, and
        keeps the hit in the blocks that hold it (invariant 9: a hit moved elsewhere holds nothing)."""
        held = self.state.seqs[seq].table
        moved = [
            index
            for index, block in enumerate(held)
            if index >= len(result.block_table) or result.block_table[index] != block
        ]
        if moved:
            self.fail(
                Invariant.CACHE_SOUNDNESS,
                f"resume of {seq} maps its cached logical block {moved[0]} to block "
                f"{result.block_table[moved[0]] if moved[0] < len(result.block_table) else 'none'}",
                [
                    f"expected: the blocks its admission's hit holds (loaded or matched), {list(held)}, then the rest",
                    f"found:    {list(result.block_table)}",
                    *self.pools.block_story(held[moved[0]]),
                ],
            )
        if result.num_cached_tokens != covered or result.loads or result.waits_for_loads:
            self.fail(
                Invariant.RESULTS,
                f"resume of {seq} reports {result.num_cached_tokens} cached tokens, loads {list(result.loads)}"
                + (" and waits for them" if result.waits_for_loads else ""),
                [
                    f"expected: the {covered} cached tokens its admission reported (loaded since), nothing more to "
                    "load, no waiting"
                ],
            )

    def host_transfers(self, step: int, transfers: HostTransfers, in_flight: Sequence[tuple[int, int]]) -> None:
        """Invariant 12 for ``take_transfers(step)``: stores between existing blocks, and only in-flight stores
        flushed."""
        h = self.state
        for block, host_block in transfers.stores:
            if not (
                _is_int(block)
                and 0 <= block < h.num_blocks
                and _is_int(host_block)
                and 0 <= host_block < h.num_host_blocks
            ):
                self.fail(
                    Invariant.RESULTS,
                    f"take_transfers({step}) stores block {_shown(block)} into host block {_shown(host_block)}",
                    [f"expected: a device block 0 .. {h.num_blocks - 1} and a host block 0 .. {h.num_host_blocks - 1}"],
                )
        for pair in transfers.flushed:
            if tuple(pair) not in in_flight:
                self.fail(
                    Invariant.RESULTS,
                    f"take_transfers({step}) flushes the store {pair}, which is not in flight",
                    [f"expected: one of the stores ordered and not yet landed, {sorted(in_flight)}"],
                )

    # -- invariant 2: attention ----------------------------------------------------------------------------------

    @functools.cached_property
    def kernel(self) -> AttentionKernel:
        """The attention kernel the machine's config names (made once per engine)."""
        return make_kernel(self.kernel_name, self.allocator)

    def attention(self) -> None:
        """Invariant 2: attention through the block tables, by the configured kernel, equals attention over the
        contiguous reference: bit for bit for the gather kernel, within the kernel's tolerance otherwise."""
        h = self.state
        seqs = [seq for seq in h.ids(Status.RUNNING, groups=True) if h.length(seq)]
        if not seqs:
            return
        starts = [h.sliding_window_start(seq) for seq in seqs]
        batch = PagedBatch(
            seqs,
            [h.seqs[seq].table for seq in seqs],
            starts,
            [h.length(seq) for seq in seqs],
            h.reference.queries(seqs),
            self.pools.keys,
            self.pools.values,
            h.rows,
            [h.layout(seq).size for seq in seqs],
        )
        kernel = self.kernel
        tolerance = kernel.tolerance(self.pools.keys.dtype)
        paged = kernel.attend(batch)
        mismatch = compare(paged, h.reference.attention(seqs, batch.queries, starts), tolerance)
        if mismatch is None:
            return
        seq = seqs[mismatch.row]
        self.fail(
            Invariant.ATTENTION,
            f"attention of {h.label(seq)} through its block table ({kernel.name} kernel) differs from the contiguous "
            "reference",
            [
                f"max abs difference {mismatch.max_abs_diff:g}, allowed: "
                f"{'none (bitwise)' if tolerance is None else tolerance}",
                f"reads positions {starts[mismatch.row]}..{h.length(seq) - 1}",
                f"block table: {list(h.seqs[seq].table)}",
            ],
        )

    # -- invariants 3 and 4: refcounts and the free set ----------------------------------------------------------

    def counts(self) -> Optional[PoolCounts]:
        """The sizes of the allocator's sets, or None without introspection."""
        alloc = self.introspection
        if alloc is None:
            return None
        host = self.host_introspection
        return PoolCounts(
            len(alloc.free_blocks()),
            len(alloc.cached_blocks()),
            len(alloc.pending_blocks()),
            None if host is None else len(host.host_free_blocks()),
        )

    def pending_now(self) -> set[int]:
        """The blocks the allocator holds pending (none without introspection): what a completing step may settle."""
        alloc = self.introspection
        return set() if alloc is None else set(alloc.pending_blocks())

    def unreferenced_in_inflight_window(self) -> list[int]:
        """Blocks released within the in-flight window and not referenced again: a correct allocator holds
        exactly these pending, and cannot hand them out yet."""
        h = self.state
        held = self.pools.held_until.keys() - self.pools.late_work_by_block.keys()
        return [block for block in (*self.pools.late_work_by_block, *held) if block not in h.refs.holders]

    def accounting(self, touched: Iterable[int]) -> None:
        """Refcounts and set membership of the touched blocks, and the pool-wide counts identity."""
        h = self.state
        alloc = self.introspection
        if alloc is None:
            return
        free, cached, pending = alloc.free_blocks(), alloc.cached_blocks(), alloc.pending_blocks()
        for block in touched:
            holders = h.refs.holders.get(block, ())
            found = alloc.refcount(block)
            if found != len(holders):
                self.fail(
                    Invariant.REFCOUNTS,
                    f"block {block} has refcount {found}",
                    [
                        f"expected: {len(holders)}, the block-table entries referencing it: "
                        f"{self.state.entries(holders) or 'none'}",
                        *self.pools.block_story(block),
                    ],
                )
            member_of = [
                name for name, blocks in (("free", free), ("cached", cached), ("pending", pending)) if block in blocks
            ]
            if holders and member_of:
                self.fail(
                    Invariant.FREE_SET,
                    f"block {block} is referenced by {self.state.entries(holders)} yet listed as "
                    f"{' and '.join(member_of)}",
                    self.pools.block_story(block),
                )
            if not holders and len(member_of) != 1:
                self.fail(
                    Invariant.FREE_SET,
                    f"unreferenced block {block} is in "
                    f"{' and '.join(member_of) or 'none of the free, cached and pending sets'}",
                    ["expected: exactly one of them", *self.pools.block_story(block)],
                )
            if member_of == ["cached"]:
                self.pools.seen_cached.add(block)
            else:
                self.pools.seen_cached.discard(block)
        in_window = self.unreferenced_in_inflight_window()
        if len(pending) > len(in_window):
            stuck = next(
                block
                for block in pending
                if block not in self.pools.late_work_by_block and block not in self.pools.held_until
            )
            self.fail(
                Invariant.FREE_SET,
                f"{len(pending)} block(s) pending, but only {len(in_window)} were "
                f"released within the in-flight window (W = {h.caps.inflight_window})",
                [
                    f"block {stuck} is still pending though its window has closed (last completed step: "
                    f"{self.pools.last_completed})",
                    "expected: it is back in the free or cached set",
                    *self.pools.block_story(stuck),
                ],
            )
        total = len(free) + len(cached) + len(pending) + h.refs.num_referenced()
        if total != h.num_blocks:
            self.fail(
                Invariant.FREE_SET,
                f"free + cached + pending + referenced = {len(free)} + {len(cached)} + "
                f"{len(pending)} + {h.refs.num_referenced()} = {total}",
                [f"expected: {h.num_blocks} (every block exactly once)"],
            )

    def host_transfers_unfree(self, in_use: dict[int, str]) -> None:
        """Invariant 4 on a host tier: a host block a transfer still uses (``in_use``: host block -> the transfer) is
        not in the host free set, from which another store could take it."""
        host = self.host_introspection
        if host is None or not in_use:
            return
        free = set(host.host_free_blocks())
        for block, transfer in sorted(in_use.items()):
            if block in free:
                self.fail(
                    Invariant.FREE_SET,
                    f"host block {block} is in the host free set while {transfer}",
                    ["expected: out of the host free set until that transfer is done"],
                )

    def host_accounting(self, touched: Iterable[int], released_by: str = "") -> None:
        """Invariant 4 on the host pool: each touched host block is in the host free set exactly when no swapped-out
        sequence holds it (a host block shared under ``shares_host_blocks`` until its last holder goes), and the free
        host blocks with the held ones account for every host block once."""
        host = self.host_introspection
        if host is None:
            return
        h = self.state
        held = h.host_holders()
        free = host.host_free_blocks()
        for block in touched:
            holders = held.get(block)
            if holders and block in free:
                named = " and ".join(f"{seq}'s logical block {index}" for seq, index in holders)
                self.fail(
                    Invariant.FREE_SET,
                    f"host block {block} holds swapped-out {named}, yet is listed in the host free set",
                    [
                        "expected: out of the host free set until its "
                        + ("last holder is" if len(holders) > 1 else "sequence is")
                        + " swapped in or freed"
                    ],
                )
            if not holders and block not in free:
                self.fail(
                    Invariant.FREE_SET,
                    f"host block {block} is held by no swapped-out sequence, yet is not in the host free set"
                    + (f": {released_by} leaked it" if released_by else ""),
                    [
                        "expected: back in host_free_blocks() once no swapped-out sequence holds it",
                        f"found:    host free set {sorted(free)[:20]}",
                    ],
                )
        if len(free) + len(held) != h.num_host_blocks:
            self.fail(
                Invariant.FREE_SET,
                f"free + held host blocks = {len(free)} + {len(held)} = {len(free) + len(held)}",
                [
                    f"expected: {h.num_host_blocks} (every host block exactly once)",
                    f"found:    host free set {sorted(free)[:20]}, held {sorted(held)[:20]}",
                ],
            )

    def fork_copies_declared(self, parent: str, child: str, copies: Sequence[BlockCopy]) -> None:
        """Invariant 3: fork copies blocks only when the allocator declares ``fork_copies``."""
        if copies and not self.state.caps.fork_copies:
            self.fail(
                Invariant.REFCOUNTS,
                f"fork of {parent} into {child} returned copies {list(copies)}",
                ["expected: none: the allocator does not declare fork_copies, so fork shares every block"],
            )

    def fork_table(self, parent: str, child: str, expected: tuple[int, ...], table: tuple[int, ...]) -> None:
        """Invariant 3: the child's table is the parent's, except where fork ordered a copy (``expected``: the parent's
        blocks holding tokens); look-ahead blocks beyond them are the child's own, as ``table_shape`` bounds them."""
        if table[: len(expected)] != expected:
            self.fail(
                Invariant.REFCOUNTS,
                f"fork gave {child} a block table unlike its parent {parent}'s",
                [f"expected: {list(expected)} (shared, or the copies it ordered)", f"found:    {list(table)}"],
            )

    def rollback_table(self, seq: str, before: tuple[int, ...], table: tuple[int, ...]) -> None:
        """Invariant 1: a rollback leaves a prefix of the table: every kept position stays in its block."""
        if table != before[: len(table)]:
            self.fail(
                Invariant.CONTENT,
                f"rollback of {seq} changed the blocks of positions it kept",
                [
                    f"expected: a prefix of its table before the rollback, {list(before)}",
                    f"found:    {list(table)}",
                    *(
                        line
                        for index, (old, new) in enumerate(zip(before, table))
                        if old != new
                        for line in self.pools.block_story(old)
                    ),
                ],
            )

    # -- look-ahead blocks ---------------------------------------------------------------------------------------

    def lookahead_exclusive(self, seq: str, hit_tokens: int = 0) -> None:
        """Every block of ``seq``'s table that is a look-ahead entry (beyond the blocks its tokens fill), of ``seq`` or
        of another sequence holding it, is referenced by that entry alone: a look-ahead block receives its owner's
        drafts next (invariant 5), and is never served to a cache hit (invariant 9: ``seq`` was just admitted with
        ``hit_tokens`` cached tokens)."""
        h = self.state
        hit_blocks = h.layout(seq).blocks_for(hit_tokens)
        for index, block in enumerate(h.seqs[seq].table):
            holders = h.refs.holders.get(block, set())
            if len(holders) < 2:
                continue
            ahead = sorted((other, i) for other, i in holders if i >= h.num_blocks_for(other))
            if not ahead:
                continue
            owner, owner_index = ahead[0]
            matched = index < hit_blocks and owner != seq
            self.fail(
                Invariant.CACHE_SOUNDNESS if matched else Invariant.EXCLUSIVE_WRITES,
                f"cache hit of {hit_tokens} tokens for {seq} matched look-ahead block {block} of {owner}"
                if matched
                else f"look-ahead block {block} of {owner} (its logical block {owner_index}, beyond its "
                f"{h.length(owner)} token(s)) is shared",
                [
                    f"expected: block {block} referenced by {owner} alone: a look-ahead block holds none of its "
                    "tokens, is never shared by a fork nor served to a cache hit",
                    f"found:    referenced by {sorted(holders)}",
                    *self.pools.block_story(block),
                ],
            )

    def lookahead_not_cached(self) -> None:
        """Invariant 9 under ``lookahead_blocks``: a block released as a look-ahead entry holds no K/V of any prefix,
        so the allocator never lists it as cached (reusable) content; checked until it is referenced again or free."""
        h = self.state
        alloc = self.introspection
        if alloc is None or not h.released_lookahead:
            return
        cached, free = alloc.cached_blocks(), alloc.free_blocks()
        for block in sorted(h.released_lookahead):
            if block in cached:
                self.fail(
                    Invariant.CACHE_SOUNDNESS,
                    f"block {block}, released as a look-ahead block, is listed as cached",
                    [
                        "expected: free (or pending): a look-ahead block holds no tokens of its sequence, so no "
                        "prefix may be matched to it",
                        "found:    in the cached (evictable) set",
                        *self.pools.block_story(block),
                    ],
                )
            if block in free:
                h.released_lookahead.discard(block)

    def evicted(self, before: Sequence[int]) -> list[int]:
        """The blocks that left the cached set since ``before`` was taken, in its order (empty without
        introspection)."""
        alloc = self.introspection
        if alloc is None:
            return []
        after = set(alloc.cached_blocks())
        return [block for block in before if block not in after]

    def evict_count(self, num_blocks: int, dropped: int, before: Sequence[int], evicted: Sequence[int]) -> None:
        """Invariant 4: evict(n) reports between 0 and n blocks dropped (under ``evict_rounds_up``: at least n, or
        every cached block), and, with introspection, exactly the number that left the cached set."""
        rounds_up = self.state.caps.evict_rounds_up
        if dropped < 0 or (not rounds_up and dropped > num_blocks):
            self.fail(
                Invariant.FREE_SET,
                f"evict({num_blocks}) reports {dropped} blocks dropped",
                [f"expected: between 0 and {num_blocks}" if not rounds_up else "expected: a count of blocks, >= 0"],
            )
        if self.introspection is None:
            return
        if dropped != len(evicted):
            self.fail(
                Invariant.FREE_SET,
                f"evict({num_blocks}) reports {dropped} blocks dropped, but {len(evicted)} left the cached set",
                [f"left the cached set: {sorted(evicted)}", f"cached before: {sorted(before)}"],
            )
        least = min(num_blocks, len(before))
        if rounds_up and len(evicted) < least:
            self.fail(
                Invariant.FREE_SET,
                f"evict({num_blocks}) dropped {len(evicted)} block(s) while {len(before)} were cached",
                [
                    f"expected: at least {least}: evict_rounds_up drops whole cached subtrees until at least "
                    f"{num_blocks} blocks are gone, or every cached block",
                    f"found:    dropped {sorted(evicted)}; still cached: {sorted(set(before) - set(evicted))}",
                ],
            )

    def evict_targets(self, targets: Sequence[int], before: Sequence[int], evicted: Sequence[int]) -> None:
        """Invariant 4: evict_blocks drops exactly the named blocks that were cached, and nothing else."""
        cached_before = set(before)
        kept = [block for block in targets if block in cached_before and block not in evicted]
        unnamed = [block for block in evicted if block not in targets]
        if kept or unnamed:
            self.fail(
                Invariant.FREE_SET,
                f"evict_blocks({list(targets)}) "
                + (f"left block(s) {kept} cached" if kept else f"dropped block(s) {unnamed} it was not given"),
                [
                    f"expected: exactly the named blocks that were cached dropped: "
                    f"{sorted(cached_before & set(targets))}",
                    f"found:    dropped {sorted(evicted)}",
                    *self.pools.block_story((kept or unnamed)[0]),
                ],
            )

    def cache_empty(self) -> None:
        """Invariant 4: after reset_cache no cached, unreferenced block is left."""
        if self.introspection is not None and len(self.introspection.cached_blocks()):
            self.fail(
                Invariant.FREE_SET,
                f"reset_cache left {len(self.introspection.cached_blocks())} cached unreferenced block(s)",
                ["expected: none"],
            )

    # -- invariant 5: exclusive writes ---------------------------------------------------------------------------

    def exclusive(self, block: int, seq: str, what: str) -> None:
        holders = self.state.refs.holders.get(block, set())
        others = sorted(holder for holder in holders if holder[0] != seq)
        caps = self.state.caps
        if (
            others
            and (caps.shares_scheduled_blocks or caps.recomputes_in_place)
            and self._same_content(block, seq, holders)
        ):
            return
        if others or len(holders) != 1:
            self.fail(
                Invariant.EXCLUSIVE_WRITES,
                f"{what} into block {block} while it is shared",
                [
                    f"expected: block {block} referenced by {self.state.label(seq) if caps.kv_groups else seq} alone "
                    "(copy-on-write first)",
                    f"found:    referenced by {self.state.entries(holders)}",
                    *self.pools.block_story(block),
                ],
            )

    def copy_deduplicated(self, seq: str, copy: BlockCopy, old_table: tuple[int, ...], old_len: int) -> int:
        """Invariant 5 for a grow's copy whose destination ``seq``'s table does not map after the grow: allowed only
        under ``dedupes_copied_tail``, as a copy of the partial tail block (logical block ``old_len // block_size``)
        that the grow filled, into a block no table references and the allocator does not list as cached (the
        table maps another block for it, whose content the caller checks). Returns that logical index."""
        h = self.state
        size = h.block_size
        index = old_len // size
        holders = h.refs.holders.get(copy.dst, set())
        cached = self.introspection is not None and copy.dst in self.introspection.cached_blocks()
        if not (old_len % size and index < len(old_table) and old_table[index] == copy.src):
            found = (
                f"block {copy.src} is not {seq}'s partial tail before the grow (table {list(old_table)}, "
                f"{old_len} tokens)"
            )
        elif h.length(seq) < (index + 1) * size:
            found = f"the grow leaves {seq}'s logical block {index} partial ({h.length(seq)} tokens)"
        elif holders:
            found = f"block {copy.dst} is referenced by {h.entries(holders)}"
        elif cached:
            found = f"block {copy.dst} is listed as cached: the copy overwrites cached K/V"
        else:
            return index
        self.fail(
            Invariant.EXCLUSIVE_WRITES,
            f"copy-on-write copy from block {copy.src} into block {copy.dst}, which {seq}'s table does not map after "
            "the grow",
            [
                f"expected: block {copy.dst} referenced by {seq} alone, or (dedupes_copied_tail) a copy of the partial "
                "tail the grow filled, into a block left unreferenced and uncached",
                f"found:    {found}; table after the grow {list(h.seqs[seq].table)}",
                *self.pools.block_story(copy.dst),
            ],
        )

    def deduplicated_tail(self, seq: str, index: int, dst: int) -> None:
        """Invariant 1 under ``dedupes_copied_tail``: the block ``seq``'s table maps at logical block ``index`` in
        place of the copy into ``dst`` holds every written position of it (bit for bit), or, under
        ``hits_scheduled_writes``, the next step writes it there before anything reads it."""
        h = self.state
        size = h.block_size
        block = h.seqs[seq].table[index]
        tags = h.reference.tags(seq)
        present: list[tuple[str, int]] = []
        scheduled: Optional[dict[int, int]] = None  # the next step's writes, gathered once if needed
        for position in range(index * size, min((index + 1) * size, h.seqs[seq].written)):
            slot = block * size + position % size
            record = self.pools.record(slot)
            if record is not None and record.tag == tags[position]:
                present.append((seq, position))
                continue
            if h.caps.hits_scheduled_writes:
                scheduled = h.scheduled_tags() if scheduled is None else scheduled
                if scheduled.get(slot) == tags[position]:
                    continue
            self.fail(
                Invariant.CONTENT,
                f"grow of {seq} maps its logical block {index} to block {block} in place of its copy into block "
                f"{dst}, but {self.where(seq, position)} holds another prefix's K/V",
                [
                    f"expected: K/V of {self.prefix(seq, position)} (dedupes_copied_tail: a block holding the same "
                    "K/V)",
                    f"found:    {self.found(record)}",
                    *self.pools.block_story(block),
                ],
            )
        self.content((), present)

    def _same_content(self, block: int, seq: str, holders: set) -> bool:
        """Every holder maps ``block`` at ``seq``'s logical index and expects the same tags in all of it (they matched
        exactly the content ``seq`` writes), and no other holder has read it yet (each gained it in this scheduling
        round: ``shares_scheduled_blocks``), unless the allocator declares ``recomputes_in_place``."""
        h = self.state
        mine = [index for holder, index in holders if holder == seq]
        if len(mine) != 1:
            return False
        layout = h.layout(seq)
        lo, hi = layout.first_position(mine[0]), layout.first_position(mine[0] + 1)
        tags = h.reference.tags(seq)
        if not all(index == mine[0] and h.reference.tags(holder)[lo:hi] == tags[lo:hi] for holder, index in holders):
            return False
        if h.caps.recomputes_in_place:
            return True
        step = self.pools.next_step
        return all(h.seqs[holder].joined_step == step for holder, _ in holders if holder != seq)

    # -- invariant 6: non-reuse window ---------------------------------------------------------------------------

    def outside_inflight_window(self, blocks: Iterable[int], seq: str) -> None:
        """Invariant 6: no block handed to ``seq`` for writing still has in-flight work that may land on it."""
        pools = self.pools
        for block in blocks:
            work = pools.late_work_by_block.get(block)
            if work is not None and work.lands_at == UNTIL_LOADS_LAND:
                self.fail(
                    Invariant.NON_REUSE_WINDOW,
                    f"block {block} handed to {seq} for writing while an asynchronous load still fills it",
                    [
                        f"block {block} was released by {work.released_by} while step {work.released_at} was being "
                        "scheduled, with a host-tier load into it under way; the worker writes it until the load is "
                        "reported landed (loads_landed), which it has not been",
                        *pools.block_story(block),
                    ],
                )
            if work is not None:
                completed = work.lands_at - pools.inflight_window
                self.fail(
                    Invariant.NON_REUSE_WINDOW,
                    f"block {block} handed to {seq} for writing before its in-flight window closed",
                    [
                        f"block {block} was released by {work.released_by} while step {work.released_at} was "
                        f"being scheduled ({f'step {completed}' if completed >= 0 else 'no step'} completed "
                        f"yet); with W = {pools.inflight_window}, work issued before then may touch it until step "
                        f"{work.lands_at} completes",
                        f"found:    handed out while step {pools.next_step} is being scheduled, and step "
                        f"{work.lands_at} has not completed",
                        *pools.block_story(block),
                    ],
                )

    # -- invariants 7, 8 and 11: refusals ------------------------------------------------------------------------

    def cached_set(self) -> Optional[frozenset[int]]:
        """The allocator's cached (evictable) blocks now, or None without introspection."""
        alloc = self.introspection
        return None if alloc is None else frozenset(alloc.cached_blocks())

    def unchanged(
        self,
        invariant: Invariant,
        before: Optional[PoolCounts],
        error: Exception,
        absent: Optional[str] = None,
        cached_before: Optional[frozenset[int]] = None,
    ) -> frozenset[int]:
        """After a refusal, every running table, the touched refcounts and the counts are as before; returns the
        blocks the refusal evicted.

        ``cached_before`` (the cached set before the call) is given where the allocator declares ``refusal_evicts``:
        then cached blocks may have moved to the free set, and nothing else."""
        h = self.state
        for seq, model in h.seqs.items():
            if model.status is not Status.RUNNING:
                continue
            table = self.allocator_table(seq)
            if table != model.table:
                self.fail(
                    invariant,
                    f"refused with {type(error).__name__}, but the block table of {h.label(seq)} changed",
                    [f"refusal: {error}", f"expected: {list(model.table)}", f"found:    {list(table)}"],
                )
        if absent is not None:
            try:
                absent_table = tuple(self.allocator.block_table(absent))
            except Misuse:
                pass
            else:
                self.fail(
                    invariant,
                    f"refused with {type(error).__name__}, but {absent} now has a block table",
                    [f"refusal: {error}", f"found: {list(absent_table)}"],
                )
        after = self.counts()
        evicted = self._evicted_by_refusal(invariant, before, error, cached_before)
        if before is not None and evicted:
            before = attrs.evolve(before, free=before.free + len(evicted), cached=before.cached - len(evicted))
        if after != before:
            self.fail(
                invariant,
                f"refused with {type(error).__name__}, but the pool changed",
                [
                    f"refusal: {error}",
                    f"expected: {before} (as before the call"
                    + (
                        f", less the {len(evicted)} evicted cached block(s) {sorted(evicted)} now free)"
                        if evicted
                        else ")"
                    ),
                    f"found:    {after}",
                ],
            )
        self.accounting({*h.refs.holders, *evicted})
        return evicted

    def only_drops(self, seq: str, table: tuple[int, ...], error: Exception) -> None:
        """Invariant 7 under ``refusal_drops_window``: a refused grow changed ``seq``'s table (or group table) at most
        by dropping entries (block -> ``NULL_BLOCK``); whether the window allowed each drop is the table's shape."""
        old = self.state.seqs[seq].table
        if len(table) == len(old) and all(new in (was, NULL_BLOCK) for was, new in zip(old, table)):
            return
        self.fail(
            Invariant.ATOMIC_REFUSAL,
            f"refused with {type(error).__name__}, but the block table of {self.state.label(seq)} changed other "
            "than by dropping blocks out of its window",
            [
                f"refusal: {error}",
                "expected: the table as before, some entries NULL_BLOCK at most (refusal_drops_window)",
                f"was:      {list(old)}",
                f"found:    {list(table)}",
            ],
        )

    def with_released(self, before: Optional[PoolCounts], released: Sequence[int]) -> Optional[PoolCounts]:
        """``before``, plus the ``released`` blocks (unreferenced now, their sets checked by the accounting) in the
        allocator's sets that hold them."""
        alloc = self.introspection
        if before is None or alloc is None or not released:
            return before
        gone = set(released)
        return attrs.evolve(
            before,
            free=before.free + len(gone & set(alloc.free_blocks())),
            cached=before.cached + len(gone & set(alloc.cached_blocks())),
            pending=before.pending + len(gone & set(alloc.pending_blocks())),
        )

    def _evicted_by_refusal(
        self,
        invariant: Invariant,
        before: Optional[PoolCounts],
        error: Exception,
        cached_before: Optional[frozenset[int]],
    ) -> frozenset[int]:
        """Under ``refusal_evicts``: the cached blocks a refusal dropped, each now free; no block became cached."""
        cached_after = self.cached_set()
        if cached_before is None or cached_after is None:
            return frozenset()
        joined = sorted(cached_after - cached_before)
        if joined:
            self.fail(
                invariant,
                f"refused with {type(error).__name__}, but block(s) {joined} became cached",
                [f"refusal: {error}", "expected: a refusal may only drop cached, unreferenced blocks (refusal_evicts)"],
            )
        return cached_before - cached_after

    def not_false(self, needed: int, error: AllocatorError, host: bool = False) -> None:
        """An out-of-blocks refusal while the free and evictable blocks cover the request is false."""
        h = self.state
        if host:
            available = h.num_host_blocks - h.host_blocks_in_use()
            where = "host pool"
        else:
            in_window = len(self.unreferenced_in_inflight_window())
            available = h.num_blocks - h.refs.num_referenced() - in_window - h.caps.reserved_blocks
            where = "device pool"
        if needed <= available:
            self.fail(
                Invariant.NO_FALSE_REFUSAL,
                f"refused for lack of blocks while the {where} could serve it",
                [
                    f"refusal: {error}",
                    f"needed:    at most {needed} block(s)",
                    f"available: {available} unreferenced block(s) outside the in-flight window"
                    + (f", beyond {h.caps.reserved_blocks} reserved" if not host and h.caps.reserved_blocks else ""),
                ],
            )

    def valid_call_refused(self, error: AllocatorError, out_of_blocks_allowed: bool) -> NoReturn:
        """Invariant 11: a call within the contract was refused with an error other than running out of blocks."""
        self.fail(
            Invariant.MISUSE,
            f"a valid call was refused with {type(error).__name__}: {error}",
            ["expected: the call to succeed" + (", or OutOfBlocks" if out_of_blocks_allowed else "")],
        )

    def misuse_refused_untyped(self, call: MisuseCall, error: Exception) -> NoReturn:
        """Invariant 11: a contract-breaking call raised something other than a Misuse error."""
        self.fail(
            Invariant.MISUSE,
            f"{call} ({call.why}) raised {type(error).__name__}: {error}",
            ["expected: a kvfuzz.allocator.errors.Misuse subclass, with nothing changed"],
        )

    def misuse_accepted(self, call: MisuseCall) -> NoReturn:
        """Invariant 11: a contract-breaking call was accepted."""
        self.fail(
            Invariant.MISUSE,
            f"{call} ({call.why}) was accepted silently",
            ["expected: a kvfuzz.allocator.errors.Misuse subclass, with nothing changed"],
        )

    # -- invariant 9: cache soundness ----------------------------------------------------------------------------

    def withdrawn_writes_unread(self, seq: str, why: str) -> None:
        """Invariant 9: withdrawing ``seq``'s scheduled writes (``why``: a preemption, or an abort whose engine does not
        declare ``free_lands_scheduled_writes``) leaves no other sequence holding a cache hit on them; a hit on
        scheduled writes is sound only while the step that writes them is sure to run. A slot a step has already
        written with the holder's K/V (a rewrite in place, ``recomputes_in_place``) loses nothing."""
        h = self.state
        mine = h.layout(seq)
        for position, slot in h.scheduled_writes(seq):
            block = mine.block_of(slot)
            record = self.pools.record(slot)
            for holder, index in sorted(h.refs.holders.get(block, ())):
                relies = h.layout(holder).first_position(index) + mine.offset_of(slot)
                if holder == seq or index != mine.index(position) or h.seqs[holder].written <= relies:
                    continue
                if record is not None and record.tag == h.reference.tags(holder)[relies]:
                    continue  # a step already wrote it: the withdrawn write would only rewrite it (in place)
                self.fail(
                    Invariant.CACHE_SOUNDNESS,
                    f"{why} withdraws {seq}'s scheduled write of position {position} into block {block}, which "
                    f"{holder}'s cache hit covers",
                    [
                        f"{holder} holds block {block} as its logical block {index} and counts position "
                        f"{relies} as computed: its admission hit K/V that {seq}'s next step was to write",
                        f"expected: a hit only on K/V a step is sure to write (an engine whose {why.split('(')[0]} "
                        "withdraws scheduled writes must not let another request hit them; vLLM lands an "
                        "aborted request's scheduled step: free_lands_scheduled_writes)",
                        f"found:    {holder} would read K/V at position {relies} that no step writes",
                        *self.pools.block_story(block),
                    ],
                )

    def hit_on_evicted(self, seq: str, num_cached: int, table: tuple[int, ...], evicted: dict[int, str]) -> None:
        """Invariant 9: a hit covers no block an eviction dropped from the cache and no table has mapped since,
        whatever K/V the block still holds. ``evicted`` maps such a block's logical index in ``table`` to the
        eviction."""
        first_position = self.state.layout(seq).first_position
        for index, eviction in sorted(evicted.items()):
            if first_position(index) < num_cached:
                self.fail(
                    Invariant.CACHE_SOUNDNESS,
                    f"cache hit of {num_cached} tokens for {seq} covers logical block {index} (block {table[index]}), "
                    "which an eviction dropped from the cache",
                    [
                        f"expected: a hit that stops before logical block {index} (position {first_position(index)}): "
                        "the "
                        f"block was evicted by {eviction}, and no table has mapped it since",
                        f"found:    {num_cached} cached tokens, running on past it",
                        *self.pools.block_story(table[index]),
                    ],
                )

    def cache_hit(self, seq: str, num_cached: int, loading: Collection[int] = ()) -> bool:
        """Invariant 9 for an admission's reported hit; returns whether it covers K/V only the next step writes.

        ``loading``: device blocks a host-tier load fills when the next step is launched (``host_cache``); a hit on
        them awaits that step, and their content is checked when the load lands."""
        h = self.state
        length = len(h.reference.tokens(seq))
        if num_cached > length:
            self.fail(
                Invariant.CACHE_SOUNDNESS,
                f"admit of {seq} reports {num_cached} cached tokens",
                [f"expected: at most the prompt's {length} tokens"],
            )
        if num_cached and not h.caps.prefix_cache:
            self.fail(
                Invariant.CACHE_SOUNDNESS,
                f"admit of {seq} reports {num_cached} cached tokens",
                ["expected: 0: the allocator does not declare a prefix cache"],
            )
        if num_cached and num_cached == length and not h.caps.recomputes_last_token:
            self.fail(
                Invariant.CACHE_SOUNDNESS,
                f"admit of {seq} reports a cache hit of its whole prompt ({length} tokens)",
                [
                    f"expected: at most {length - 1} cached tokens: the engine needs at least one query token to "
                    "sample the next token from, and a request prefilled with none is handed another request's "
                    "logits (an allocator whose engine recomputes the last token itself declares "
                    "recomputes_last_token)",
                    f"found:    all {length} positions reported cached, up to {self.where(seq, length - 1)}",
                ],
            )
        layout = h.layout(seq)
        table = h.seqs[seq].table
        awaits_step = False
        scheduled: Optional[dict[int, int]] = None  # the next step's writes, gathered once if a hit needs them
        for position in range(num_cached):
            if table[layout.index(position)] == NULL_BLOCK:
                continue
            slot = layout.slot_of(table, position)
            if layout.block_of(slot) in loading:
                awaits_step = True  # a host-tier load fills it before the next step reads it
                continue
            record = self.pools.record(slot)
            tag = h.reference.tags(seq)[position]
            if h.caps.hits_scheduled_writes and record is not None and record.tag == tag:
                continue  # written by a launched step
            if h.caps.hits_scheduled_writes:
                scheduled = h.scheduled_tags() if scheduled is None else scheduled
                if scheduled.get(slot) == tag:
                    awaits_step = True  # written by the next step, before anything reads it
                    continue
            if record is None or record.tag != tag or record.step > self.pools.last_completed:
                why, cause = self._unsound_hit(seq, position, slot, record, tag)
                self.fail(
                    Invariant.CACHE_SOUNDNESS,
                    f"cache hit of {num_cached} tokens for {h.label(seq) if h.caps.kv_groups else seq} covers "
                    f"position {position}, but {why}",
                    [
                        self.where(seq, position),
                        f"expected: K/V of {self.prefix(seq, position)}, written "
                        + (
                            "by a step, or scheduled by a live sequence for the next one"
                            if h.caps.hits_scheduled_writes
                            else "by a completed step"
                        ),
                        f"found:    {self.found(record)}",
                        *cause,
                        *self.pools.block_story(layout.block_of(slot)),
                    ],
                )
        return awaits_step

    def _unsound_hit(
        self, seq: str, position: int, slot: int, record: Optional[SlotWrite], tag: int
    ) -> tuple[str, list[str]]:
        """Why a hit may not cover ``slot``, for the summary, and the root-cause lines: what the slot holds, or
        which scheduled write will fill it."""
        h = self.state
        writer = h.scheduled_writer(slot) if record is None or record.tag != tag else None
        next_step = self.pools.next_step
        if writer is not None and h.reference.tags(writer[0])[writer[1]] == tag:
            return (
                f"nothing is written there yet: {writer[0]} writes it at the next step (step {next_step})",
                [
                    f"root cause: the block became matchable when {writer[0]}'s write was scheduled, not when a step "
                    "had written it; only an allocator that declares hits_scheduled_writes may count K/V a step "
                    "has yet to write as cached"
                ],
            )
        if writer is not None:
            theirs = self._block_content(writer[0], h.layout(writer[0]).index(writer[1]))
            mine = self._block_content(seq, h.layout(seq).index(position))
            return (
                f"another prefix's scheduled write will fill it: {writer[0]} position {writer[1]} writes there at "
                f"the next step (step {next_step})",
                [
                    f"root cause: the hit matched a block that {writer[0]} is about to fill with other K/V:",
                    f"  {seq} expects {self._content(mine)}",
                    f"  {writer[0]} writes {self._content(theirs)}",
                    f"  {self._why_alike(mine, theirs)}, or the block's cache entry outlived a change to "
                    f"{writer[0]}'s tokens (a rollback, see the block's history)",
                ],
            )
        if record is None:
            return "nothing has been written there, and no live sequence is scheduled to write it", []
        if record.tag != tag:
            return "it holds another prefix's K/V", self.root_cause(seq, position, slot, record)
        return f"the step that put it there has not completed (last completed: {self.pools.last_completed})", []

    # -- invariant 13: eviction order (a declared policy) ---------------------------------------------------------

    def cache_snapshot(self) -> Optional[CacheSnapshot]:
        """What the eviction-order and complete-caching checks need before an operation that may evict, or None when
        neither policy is declared (or the allocator cannot show its sets)."""
        alloc = self.introspection
        if alloc is None or (self.state.caps.eviction_order is None and not self.owes_caching()):
            return None
        return CacheSnapshot(
            tuple(alloc.cached_blocks()), frozenset(alloc.free_blocks()), tuple(self.state.refs.released)
        )

    def evictions(self, before: Optional[CacheSnapshot], hits: Iterable[int], reuse: bool) -> None:
        """The cached blocks an operation evicted or reused (every block that left the cached set, other than by a
        hit): the complete-caching debt for them ends, and invariant 13 holds of them. Invariant 13: they are the
        least recently released ones, and, when the operation handed them out for new content (``reuse``), no block
        that was free before it is still free."""
        alloc = self.introspection
        if before is None or alloc is None:
            return
        hit = set(hits)
        cached_after = set(alloc.cached_blocks())
        gone = [block for block in before.cached if block not in cached_after and block not in hit]
        self.state.matchable.forget(gone)
        if not gone or self.state.caps.eviction_order is None:
            return
        was_cached = set(before.cached) - hit
        known = [block for block in before.recency if block in was_cached]
        released = set(known)  # a cached block the engine never saw released is counted oldest
        order = [block for block in before.cached if block in was_cached and block not in released] + known
        oldest = order[: len(gone)]
        if set(gone) != set(oldest):
            wrong = next(block for block in gone if block not in oldest)
            skipped = next(block for block in oldest if block not in gone)
            self.fail(
                Invariant.EVICTION_ORDER,
                f"{'reused' if reuse else 'evicted'} cached block {wrong} before block {skipped}, which was released "
                "earlier",
                [
                    f"expected: least recently released first (LRU; a release frees its tail blocks first): {oldest}",
                    f"found:    {'reused' if reuse else 'evicted'} {gone}",
                    f"cached blocks, least recently released first: {order}",
                    *self.pools.block_story(wrong),
                    *self.pools.block_story(skipped),
                ],
            )
        still_free = sorted(before.free & set(alloc.free_blocks())) if reuse else []
        if still_free:
            self.fail(
                Invariant.EVICTION_ORDER,
                f"reused cached block {gone[0]} for new content while block {still_free[0]} was free",
                [
                    "expected: a cached block is evicted for new content only once no free block is left",
                    f"found:    reused {gone}; still free: {still_free}",
                    *self.pools.block_story(gone[0]),
                    *self.pools.block_story(still_free[0]),
                ],
            )

    # -- invariant 14: complete caching (a declared policy) -------------------------------------------------------

    def owes_caching(self) -> bool:
        """Whether the allocator declares complete caching and shows its sets (without a sliding window, whose
        dropped blocks a hit may legitimately skip)."""
        caps = self.state.caps
        return caps.complete_caching and self.introspection is not None and caps.sliding_window is None

    def _kept(self, tag: int) -> list[tuple[int, str]]:
        """The blocks owed matchable as prefix ``tag`` that the allocator keeps: referenced, cached or pending."""
        alloc = self.introspection
        assert alloc is not None
        holders = self.state.matchable.holders(tag)
        if not holders:
            return []
        cached, pending, referenced = alloc.cached_blocks(), alloc.pending_blocks(), self.state.refs.holders
        return [(b, w) for b, w in holders.items() if b in referenced or b in cached or b in pending]

    def owed_hit(self, tags: Sequence[int]) -> list[tuple[int, str]]:
        """For a prompt with these position tags, one (block, who wrote it) per leading full block an admission
        must report cached: a block owed matchable holds its prefix (a block that went to the free set without an
        eviction is still owed). A hit never covers the whole prompt (the engine needs a query token), so its last
        token's block is never owed."""
        size = self.state.layouts[0].size  # a sequence's own table (group 0's)
        matchable = self.state.matchable
        owed: list[tuple[int, str]] = []
        for index in range((len(tags) - 1) // size):
            holders = matchable.holders(tags[(index + 1) * size - 1])
            if not holders:
                break
            owed.append(next(iter(holders.items())))
        return owed

    def missed_hit(self, seq: str, num_cached: int, owed: Sequence[tuple[int, str]]) -> None:
        """Invariant 14: an admission reports at least the cached tokens the cache owes it."""
        size = self.state.layout(seq).size
        if num_cached >= len(owed) * size:
            return
        index = num_cached // size
        block, written = owed[index]
        self.fail(
            Invariant.COMPLETE_CACHING,
            f"admission of {seq} reports {num_cached} cached tokens, but its first {len(owed) * size} are matchable "
            "(a missed hit)",
            [
                f"logical block {index} (positions {index * size}..{(index + 1) * size - 1}, "
                f"{self.prefix(seq, (index + 1) * size - 1)}): block {block} holds its K/V, written by {written}, "
                "and no eviction has dropped it",
                f"expected: at least {len(owed) * size} cached tokens (complete caching; a hit never covers the "
                "whole prompt)",
                f"found:    {num_cached}",
                *self.pools.block_story(block),
            ],
        )

    def released_matchable(self, block: int) -> None:
        """Invariant 14: a block owed matchable that its last holder released stays matchable (it, or another block
        holding the same prefix, is cached or pending), rather than going to the free set."""
        tag = self.state.matchable.tag_of.get(block)
        if tag is None or self._kept(tag):
            return
        self.fail(
            Invariant.COMPLETE_CACHING,
            f"block {block} went to the free set when it was released, though the cache owes its prefix",
            [
                f"block {block} holds a full block written by {self.state.matchable.holders(tag)[block]}",
                "expected: it stays cached (matchable for its namespace and prefix) until it is evicted or the cache "
                "reset",
                "found:    no block holding that prefix is referenced, cached or pending",
                *self.pools.block_story(block),
            ],
        )

    # -- invariant 10: quiescence --------------------------------------------------------------------------------

    def quiescent(self) -> None:
        h = self.state
        alloc = self.introspection
        if alloc is None:
            return
        for block in self.pools.history:
            if alloc.refcount(block) != 0:
                self.fail(
                    Invariant.QUIESCENCE,
                    f"every sequence is gone, yet block {block} has refcount {alloc.refcount(block)}",
                    self.pools.block_story(block),
                )
        free, cached, pending = alloc.free_blocks(), alloc.cached_blocks(), alloc.pending_blocks()
        reusable = len(free) + (0 if h.caps.eviction else len(cached))
        if reusable != h.num_blocks or len(pending):
            lost = sorted(set(range(h.num_blocks)) - set(free) - set(cached))
            self.fail(
                Invariant.QUIESCENCE,
                f"every sequence is gone and the cache reset, yet only {reusable} of {h.num_blocks} blocks are free",
                [
                    f"pending: {len(pending)}",
                    f"leaked: {lost[:20]}",
                    *(line for block in lost[:2] for line in self.pools.block_story(block)),
                ],
            )
        if not isinstance(free, collections.abc.Set) and len(set(free)) != len(free):
            duplicated = sorted(block for block, n in collections.Counter(free).items() if n > 1)
            self.fail(
                Invariant.QUIESCENCE,
                f"the free set lists block(s) {duplicated} more than once",
                self.pools.block_story(duplicated[0]),
            )
        host = self.host_introspection
        if host is not None:
            host_free = host.host_free_blocks()
            if len(host_free) != h.num_host_blocks or set(host_free) != set(range(h.num_host_blocks)):
                self.fail(
                    Invariant.QUIESCENCE,
                    f"every sequence is gone, yet the host free set holds {len(host_free)} entries for "
                    f"{h.num_host_blocks} host blocks",
                    [
                        f"expected: every host block 0..{h.num_host_blocks - 1} free, once",
                        f"leaked:   {sorted(set(range(h.num_host_blocks)) - set(host_free))[:20]}",
                    ],
                )

    def whole_pool_admissible(self, probe: str) -> None:
        """Invariant 10 without introspection: leaks show as a refusal, so one sequence as large as the whole pool
        (less the reserved blocks) must be admitted, then it is freed."""
        h = self.state
        usable = (h.num_blocks - h.caps.reserved_blocks) // max(1, len(h.caps.kv_groups))  # every group needs its own
        tokens = tuple(itertools.islice(itertools.cycle(range(97, 101)), usable * h.block_size))
        try:
            self.allocator.admit(probe, ("kvfuzz-quiescence-probe",), tokens)
        except OutOfBlocks as error:
            self.fail(
                Invariant.QUIESCENCE,
                f"every sequence is gone, yet a {usable}-block sequence is refused: {error}",
                ["some blocks leaked"],
            )
        self.allocator.free(probe)
