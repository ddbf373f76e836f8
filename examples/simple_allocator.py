"""A minimal allocator plugged into kvfuzz: no sharing, no prefix cache, no swap; rollback supported.

Run kvfuzz against it with:  kvfuzz run --allocator examples.simple_allocator:make_allocator
"""

from __future__ import annotations

from kvfuzz.allocator import (
    AdmitResult,
    Capabilities,
    GrowResult,
    InvalidArgument,
    OutOfBlocks,
    PoolSpec,
    SequenceExists,
    Slot,
    UnknownSequence,
)


class SimpleAllocator:
    """Each sequence owns its blocks outright; freed blocks go back to a free list at once (W = 0)."""

    capabilities = Capabilities(rollback=True)

    def __init__(self, spec: PoolSpec) -> None:
        self.block_size, self.num_blocks, self.num_host_blocks = spec.block_size, spec.num_blocks, 0
        self.free_list = list(range(spec.num_blocks))
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    def _take(self, count: int) -> list[int]:
        if count > len(self.free_list):
            raise OutOfBlocks(f"need {count} blocks, {len(self.free_list)} free")
        taken, self.free_list = self.free_list[:count], self.free_list[count:]
        return taken

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def admit(self, seq, namespace, tokens):
        if seq in self.tables:
            raise SequenceExists(seq)
        if not tokens:
            raise InvalidArgument("no tokens")
        self.tables[seq] = self._take(self._blocks_for(len(tokens)))
        self.lengths[seq] = len(tokens)
        return AdmitResult(self.tables[seq], num_cached_tokens=0)

    def grow(self, seq, tokens):
        if seq not in self.tables:
            raise UnknownSequence(seq)
        if not tokens:
            raise InvalidArgument("no tokens")
        old, new = self.lengths[seq], self.lengths[seq] + len(tokens)
        self.tables[seq] += self._take(self._blocks_for(new) - len(self.tables[seq]))
        self.lengths[seq] = new
        table = self.tables[seq]
        return GrowResult([Slot(table[p // self.block_size], p % self.block_size) for p in range(old, new)])

    def free(self, seq):
        if seq not in self.tables:
            raise UnknownSequence(seq)
        self.free_list += self.tables.pop(seq)
        del self.lengths[seq]

    preempt = free

    def rollback(self, seq, num_tokens):
        if seq not in self.tables:
            raise UnknownSequence(seq)
        if not 1 <= num_tokens < self.lengths[seq]:
            raise InvalidArgument(f"cannot drop {num_tokens} of {self.lengths[seq]} tokens")
        self.lengths[seq] -= num_tokens
        keep = self._blocks_for(self.lengths[seq])
        self.free_list += self.tables[seq][keep:]
        del self.tables[seq][keep:]

    def block_table(self, seq):
        if seq not in self.tables:
            raise UnknownSequence(seq)
        return tuple(self.tables[seq])

    def step_completed(self, step):
        pass


def make_allocator(spec: PoolSpec) -> SimpleAllocator:
    return SimpleAllocator(spec)
