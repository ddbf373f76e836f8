"""Invariant 12, well-formed results: every operation returns the contract's type with integer block ids and counts,
and every table read back has the shape its tokens (and look-ahead) give it."""

from __future__ import annotations

import collections.abc
from typing import Iterable, Optional, Sequence

from kvfuzz.allocator.types import (
    NULL_BLOCK,
    AdmitResult,
    BlockCopy,
    GrowResult,
    HostTransfers,
    Slot,
    SwapResult,
)
from kvfuzz.engine.checks.context import Checker
from kvfuzz.engine.violations import Cause, Invariant


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def non_ints(values: Iterable[object]) -> list[object]:
    """The values that are not ints (an exact int is passed over without the call: most values are)."""
    return [value for value in values if type(value) is not int and not is_int(value)]


def shown(value: object) -> str:
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
        return None if is_int(result) else shown(result)
    if expected is tuple:
        items: Sequence[object] = result if isinstance(result, tuple) else ()
        if not isinstance(result, tuple) or not all(isinstance(copy, BlockCopy) for copy in items):
            return shown(result)
        numbers = [number for copy in result for number in (copy.src, copy.dst)]
    elif not isinstance(result, expected):
        return shown(result)
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
    bad = non_ints(numbers)
    return None if not bad else f"{shown(result)}: {shown(bad[0])} where an int belongs"


class ResultChecks(Checker):
    """Invariant 12 (and a table's shape, which invariants 1 and 3 own): results as the contract types them."""

    def result(self, result: object, expected: type, operation: Optional[str] = None) -> None:
        """Invariant 12: an operation (``operation``, by default the one being checked) returned the contract's
        result type, with integer block ids and counts.

        ``None`` in particular is never a refusal (a refusal raises ``OutOfBlocks``), so it is not counted as one."""
        problem = _malformed(result, expected)
        if problem is not None:
            self.fail(
                Invariant.RESULTS,
                f"{self.context.operation if operation is None else operation} returned {shown(result)}",
                [
                    f"expected: {expected.__name__}{_RESULT_SHAPES.get(expected, '')}; a refusal raises "
                    "kvfuzz.allocator.errors.OutOfBlocks",
                    f"found:    {problem}",
                ],
                Cause(f"a result that is not a well-formed {expected.__name__}"),
            )

    def block_table(self, seq: str, table: object) -> tuple[int, ...]:
        """Invariant 12: ``block_table(seq)`` returned a sequence of int block ids (NULL_BLOCK for a dropped block);
        returns it as a tuple."""
        if not isinstance(table, collections.abc.Sequence) or isinstance(table, (str, bytes)):
            self.fail(
                Invariant.RESULTS,
                f"block_table({seq!r}) returned {shown(table)}",
                ["expected: a sequence of int block ids", f"found:    {shown(table)}"],
                Cause("block_table returned something other than a sequence of block ids"),
            )
        blocks = tuple(table)
        bad = non_ints(blocks)
        if bad:
            self.fail(
                Invariant.RESULTS,
                f"block_table({seq!r}) lists {shown(bad[0])}",
                ["expected: block ids as int", f"found:    {[shown(block) for block in blocks]}"],
                Cause("block_table listed a block id that is not an int"),
            )
        return blocks

    def table_shape(self, seq: str, table: tuple[int, ...]) -> None:
        h = self.state
        want, lookahead = h.num_blocks_for(seq), h.caps.lookahead_blocks
        repeated = next((block for block in table if block != NULL_BLOCK and table.count(block) > 1), None)
        if len(table) > want + lookahead and repeated is not None:  # a block appended again: why it is too long
            at = [index for index, block in enumerate(table) if block == repeated]
            self.fail(
                Invariant.REFCOUNTS,
                f"block table of {seq} holds {len(table)} block(s) for {len(h.reference.tokens(seq))} tokens, block "
                f"{repeated} {len(at)} times (logical blocks {', '.join(map(str, at))})",
                [
                    f"expected: {want} block(s), each at most once in a table (one block holds one logical block's "
                    "K/V)",
                    f"found:    {list(table)}",
                ],
                Cause("a block repeated in one table"),
            )
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
                Cause(f"a block table {'longer' if len(table) > want else 'shorter'} than its tokens need"),
            )
        bad = [block for block in table if not 0 <= block < h.num_blocks and block != NULL_BLOCK]
        if bad:
            self.fail(
                Invariant.REFCOUNTS,
                f"block table of {seq} names block(s) {bad} outside the pool",
                [f"expected: blocks in 0..{h.num_blocks - 1}", f"found:    {list(table)}"],
                Cause("a block table naming a block outside the pool"),
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
                Cause("a block table that drops a block attention still reads"),
            )

    def waits_for_loads(self, seq: str, result: AdmitResult) -> None:
        """An admission that waits for its loads: only under ``async_loads``, with loads to wait for."""
        h = self.state
        if not h.caps.async_loads:
            self.fail(
                Invariant.RESULTS,
                f"admit of {seq} waits for its loads",
                ["expected: an admission that does not wait: the allocator does not declare async_loads"],
                Cause("an admission that waits for its loads without declaring async_loads"),
            )
        if not result.loads:
            self.fail(
                Invariant.RESULTS,
                f"admit of {seq} waits for its loads but orders none",
                ["expected: host-tier loads to wait for (an admission with nothing to load does not wait)"],
                Cause("an admission that waits for loads it does not order"),
            )
