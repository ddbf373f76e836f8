"""Invariant 2, attention: attention through the block tables equals attention over the contiguous reference."""

from __future__ import annotations

import functools

from kvfuzz.engine.checks.context import CheckContext, Checker
from kvfuzz.engine.expected import Status
from kvfuzz.engine.violations import Cause, Invariant
from kvfuzz.kernels import AttentionKernel, PagedBatch, compare, make_kernel


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
            Cause("attention through the block table that differs from the contiguous reference"),
        )
