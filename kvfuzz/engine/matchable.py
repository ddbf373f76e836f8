"""What an allocator that declares complete caching must keep matchable: every full block a completed step wrote, for
its namespace and prefix, until it is evicted or the cache reset.

A full block's prefix is named by the tag of its last position (the tag chains the namespace and every token before
it). Writes scheduled while step c was the last completed land in a step that has completed once step c + W + 1 has,
so a block filled by them is owed from then on, if the sequence that wrote it still maps it there and has not
dropped those tokens meanwhile (a rollback into the block, a preemption, a swap-out or a free before step c + W + 1
completes cancels the promise: the block's content was never owed, and the allocator may write it anew in place);
an allocator that registers blocks earlier (vLLM, when scheduled) meets the promise early.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Iterator

import attrs

from kvfuzz.allocator.types import SeqId


@attrs.frozen
class Filled:
    """A full block a step wrote: owed matchable once step ``due`` has completed, if ``seq`` still maps it at
    logical block ``index``."""

    due: int  # the step after whose completion the block is owed
    seq: SeqId  # the sequence whose writes filled it
    index: int  # its logical block in that sequence
    block: int  # the physical block
    tag: int  # the tag of its last position: its namespace and prefix
    written: str  # who wrote it and when, for a person


class MatchablePrefixes:
    """The blocks owed matchable, by prefix. Invariant kept: ``blocks_by_tag[t]`` holds, with who wrote it, every
    block owed matchable as prefix t and not evicted or handed out for new content since; ``tag_of`` is its
    inverse; ``filled`` holds the blocks not yet owed, in order of ``due``."""

    def __init__(self) -> None:
        self.blocks_by_tag: dict[int, dict[int, str]] = {}  # prefix tag -> block -> who wrote it and when
        self.tag_of: dict[int, int] = {}  # block -> the prefix tag it is owed matchable as
        self.filled: deque[Filled] = deque()  # blocks a launched step fills, owed once their step has completed

    def fill(self, filled: Filled) -> None:
        self.filled.append(filled)

    def due(self, step: int) -> Iterator[Filled]:
        """The filled blocks owed once ``step`` has completed, removed from the waiting list."""
        while self.filled and self.filled[0].due <= step:
            yield self.filled.popleft()

    def cancel(self, seq: SeqId, first_index: int = 0) -> None:
        """``seq`` dropped its tokens from logical block ``first_index`` on before the blocks they filled were owed:
        those blocks are owed nothing (even if the same tokens are written into the same block again, which a new
        fill records with its own step)."""
        self.filled = deque(filled for filled in self.filled if filled.seq != seq or filled.index < first_index)

    def owe(self, filled: Filled) -> None:
        """``filled.block`` is owed matchable as its prefix from now on."""
        self.forget((filled.block,))
        self.blocks_by_tag.setdefault(filled.tag, {})[filled.block] = filled.written
        self.tag_of[filled.block] = filled.tag

    def forget(self, blocks: Iterable[int]) -> None:
        """These blocks were evicted or handed out for new content: nothing is owed for them any more."""
        for block in blocks:
            tag = self.tag_of.pop(block, None)
            if tag is not None:
                holders = self.blocks_by_tag[tag]
                del holders[block]
                if not holders:
                    del self.blocks_by_tag[tag]

    def holders(self, tag: int) -> dict[int, str]:
        """The blocks owed matchable as prefix ``tag``, with who wrote each."""
        return self.blocks_by_tag.get(tag, {})
