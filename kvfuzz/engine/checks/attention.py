"""Invariant 2, attention: attention through the block tables equals attention over the contiguous reference."""

from __future__ import annotations

import functools

import attrs
import torch

from kvfuzz.allocator.types import SeqId
from kvfuzz.engine.checks.content import clobbered
from kvfuzz.engine.checks.context import CheckContext, Checker
from kvfuzz.engine.expected import Status
from kvfuzz.engine.violations import Cause, Invariant
from kvfuzz.kernels import AttentionKernel, GatherKernel, PagedBatch, compare, make_kernel

UNEXPLAINED_ATTENTION = Cause("attention through the block table that differs from the contiguous reference")
"""The cause of an attention mismatch where every position read holds its own K/V by the shadow record (values
that differ from what was written, or a kernel that reads them wrong)."""

_NO_QUERIES = torch.empty(0)
"""The queries of a batch made to read K/V alone."""

_NO_POOL = torch.empty(0)
"""The pools of a batch whose reads are first decided by their tags (the tensors are put in when read)."""


class AttentionCheck(Checker):
    """Invariant 2, by the attention kernel the machine's config names (made once per engine, on first use)."""

    def __init__(self, context: CheckContext, kernel_name: str) -> None:
        super().__init__(context)
        self.kernel_name = kernel_name  # invariant 2's attention kernel

    @functools.cached_property
    def kernel(self) -> AttentionKernel:
        """The attention kernel the machine's config names (made once per engine)."""
        return make_kernel(self.kernel_name, self.allocator, self.pools.shape)

    def check(self) -> None:
        """Invariant 2: attention through the block tables, by the configured kernel, equals attention over the
        contiguous reference: bit for bit for the gather kernel, within the kernel's tolerance otherwise."""
        h = self.state
        seqs = [seq for seq in h.ids(Status.RUNNING, groups=True) if h.length(seq)]
        if not seqs:
            return
        starts = [h.sliding_window_start(seq) for seq in seqs]
        reads = PagedBatch(  # what the batch reads, before its queries are made (the gather kernel's K/V need none)
            seqs,
            [h.seqs[seq].table for seq in seqs],
            starts,
            [h.length(seq) for seq in seqs],
            _NO_QUERIES,
            _NO_POOL,  # the pools' tensors, put in only when read: the gather kernel's tag check needs none
            _NO_POOL,
            h.rows,
            [h.layout(seq).size for seq in seqs],
        )
        kernel = self.kernel
        if type(kernel) is GatherKernel and self._reads_the_reference_tags(reads, seqs, starts):  # not a subclass
            return
        reads = attrs.evolve(reads, keys=self.pools.keys, values=self.pools.values)
        if type(kernel) is GatherKernel and self._gathers_the_reference(kernel, reads, seqs, starts):
            return
        batch = attrs.evolve(reads, queries=h.reference.queries(seqs))
        tolerance = kernel.tolerance(self.pools.shape.dtype)
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
            self._why(seq, starts[mismatch.row]),
        )

    def _why(self, seq: SeqId, start: int) -> Cause:
        """The cause of ``seq``'s attention mismatch: the kind of write that left the first position it reads with
        another prefix's K/V (or none: never written), as the content check names it; where every position it reads
        holds its own K/V by the record, values that differ from what was written."""
        h = self.state
        table, layout, tags = h.seqs[seq].table, h.layout(seq), h.reference.tags(seq)
        for position in range(start, h.length(seq)):
            slot = layout.slot_of(table, position)
            record = self.pools.record(slot)
            if record is None or record.tag != tags[position]:
                return clobbered(h, seq, slot, record)
        return UNEXPLAINED_ATTENTION

    def _gathers_the_reference(
        self, kernel: GatherKernel, batch: PagedBatch, seqs: list[SeqId], starts: list[int]
    ) -> bool:
        """Whether the gather kernel reads, through the block tables, exactly the reference's K/V (every window
        bit for bit, zeros alike past its end). It then attends with the reference's own function on the same
        queries, so the two attentions are equal bit for bit and need not be computed; K/V that differ anywhere
        are left to the comparison of the attentions, which decides as it always did."""
        keys, values = kernel.gathered(batch)
        want_keys, want_values, _ = self.state.reference.windows(seqs, starts)
        return torch.equal(keys, want_keys) and torch.equal(values, want_values)

    def _reads_the_reference_tags(self, batch: PagedBatch, seqs: list[SeqId], starts: list[int]) -> bool:
        """Whether every slot the gather kernel reads has a shadow record whose tag is the reference's at that
        position. A recorded slot's K/V are its record's (``KVPools`` makes its tensors from the records), and the
        reference's K/V are its tags', so equal tags mean the K/V the kernel gathers equal the reference's windows
        bit for bit, without either being made. A slot without a record, or with
        another tag, answers False: the tensors are then compared, as before."""
        shadow, reference = self.pools.shadow, self.state.reference
        for row, seq in enumerate(seqs):
            tags = reference.tags(seq)
            for position, slot in enumerate(batch.slots(row), start=starts[row]):
                record = shadow.get(slot)
                if record is None or record.tag != tags[position]:
                    return False
        return True
