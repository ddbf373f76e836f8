"""What an attention kernel is to kvfuzz: a way to compute invariant 2's paged side, and the tolerance it is held to.

Invariant 2 compares attention read through the block tables (the kernel under test) with attention over the
contiguous reference (:func:`kvfuzz.reference.attention.attend`). When the kernel is that same function on gathered
inputs, equal K/V give equal bits; any other kernel reduces in another order and is held to a stated tolerance.
"""

from __future__ import annotations

from typing import Iterable, Optional, Protocol

import attrs
import torch

from kvfuzz.allocator.types import SeqId


@attrs.frozen
class Tolerance:
    """``|paged - expected| <= atol + rtol * |expected|`` elementwise, as :func:`torch.isclose` says."""

    atol: float
    rtol: float

    def __str__(self) -> str:
        return f"atol {self.atol:g}, rtol {self.rtol:g}"


def _seq_tuple(seqs: Iterable[SeqId]) -> tuple[SeqId, ...]:
    return tuple(seqs)


def _table_tuple(tables: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(map(tuple, tables))


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


@attrs.frozen
class PagedBatch:
    """The running sequences a step attends for, and the physical pools they read.

    Row ``i`` is sequence ``seqs[i]``: its query (of its last token) is ``queries[i]`` ``[L, Hq, D]``; it reads
    positions ``starts[i] .. lengths[i] - 1`` (``starts`` > 0 only under a sliding window), position ``p`` at pool
    row ``tables[i][p // size_i] * block_size + p % size_i``, where ``size_i = block_sizes[i]`` is the tokens a
    block holds in row i's KV-cache group (``block_size`` for every row when ``block_sizes`` is empty: the plain
    layout). ``keys`` and ``values`` are the engine's whole pools ``[num_blocks * block_size, L, Hkv, D]``, never
    copies; ``block_size`` is the rows every physical block has, and row i uses the first ``size_i`` of them.
    """

    seqs: tuple[SeqId, ...] = attrs.field(converter=_seq_tuple)
    tables: tuple[tuple[int, ...], ...] = attrs.field(converter=_table_tuple)
    starts: tuple[int, ...] = attrs.field(converter=_int_tuple)
    lengths: tuple[int, ...] = attrs.field(converter=_int_tuple)
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    block_size: int  # rows every physical block has in the pools
    # Per row, the tokens one block holds in its table (empty: block_size for every row).
    block_sizes: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)

    @property
    def num_blocks(self) -> int:
        return self.keys.shape[0] // self.block_size

    def tokens_per_block(self, row: int) -> int:
        """How many tokens one block holds in row ``row``'s table."""
        return self.block_sizes[row] if self.block_sizes else self.block_size

    def window_lengths(self) -> list[int]:
        """How many positions each row reads."""
        return [length - start for start, length in zip(self.starts, self.lengths)]

    def slots(self, row: int) -> list[int]:
        """The pool rows that row ``row`` reads, in position order."""
        table, rows, size = self.tables[row], self.block_size, self.tokens_per_block(row)
        return [table[p // size] * rows + p % size for p in range(self.starts[row], self.lengths[row])]


class AttentionKernel(Protocol):
    """Computes the paged side of invariant 2.

    ``attend`` returns ``[S, L, Hq, D]`` (any float dtype; it is compared in float32) for ``batch``, reading the
    pools only where the block tables say. ``tolerance(dtype)`` is ``None`` when the kernel must equal the reference
    bit for bit, else how far it may differ for pools of that dtype.
    """

    name: str

    def tolerance(self, dtype: torch.dtype) -> Optional[Tolerance]: ...

    def attend(self, batch: PagedBatch) -> torch.Tensor: ...


DIFFERENT_KERNEL_TOLERANCE: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.float16: Tolerance(atol=2e-3, rtol=5e-4),
    torch.bfloat16: Tolerance(atol=1.6e-2, rtol=4e-3),
}
"""How far a kernel other than the reference's may differ, per pool dtype.

Why these numbers: every K, V and query holds values in [-1, 1), and the output is a convex combination of value
rows, so it lies in [-1, 1]: absolute error is what matters, and ``rtol`` is kept to one unit roundoff u of the
dtype. Both sides read the same stored inputs; they differ only in

1. reduction order: a blocked or materialised softmax and other matmuls than the reference's batched ones, both
   accumulating in float32, which costs a few float32 ulps (1.8e-7 observed);
2. the precision the kernel keeps between its steps: FlexAttention (like most fused kernels) casts the softmax
   weights back to the input dtype and computes ``weights @ V`` and its output in that dtype, while the reference
   stays in float32 throughout. Rounding each weight (relative error u) and the output (u) costs at most about 2u
   on an output in [-1, 1].

With u = 2^-8 for bfloat16 and 2^-11 for float16, kvfuzz's runs observe at most 3.7e-3 (~0.95u) and 4.7e-4
(~0.96u); ``atol`` is 4u (1.6e-2 and 2e-3), twice the analytic bound. float32 allows 1e-5, fifty times what is
observed. A wrong value row (another position's random values) moves some output element by up to about
|v_wrong - v_right| / n with n positions read, above the bfloat16 bound for n up to a few dozen; longer sequences
dilute one wrong row below it, which is why invariant 1 checks every read position's K/V bit for bit as well.
"""


def different_kernel_tolerance(dtype: torch.dtype) -> Tolerance:
    try:
        return DIFFERENT_KERNEL_TOLERANCE[dtype]
    except KeyError:
        raise ValueError(f"no attention tolerance is stated for pools of dtype {dtype}") from None


@attrs.frozen
class Mismatch:
    """Where a kernel's result differs from the reference beyond its tolerance: the first such row, and its largest
    absolute difference."""

    row: int
    max_abs_diff: float


def compare(paged: torch.Tensor, expected: torch.Tensor, tolerance: Optional[Tolerance]) -> Optional[Mismatch]:
    """The first row where ``paged`` differs from ``expected`` (bit for bit when ``tolerance`` is None)."""
    paged = paged.float()
    if tolerance is None:
        bad = paged != expected
    else:
        bad = ~torch.isclose(paged, expected, rtol=tolerance.rtol, atol=tolerance.atol)
    rows = bad.flatten(1).any(1).nonzero().flatten()
    if not len(rows):
        return None
    row = int(rows[0])
    return Mismatch(row, float((paged[row] - expected[row]).abs().max()))


class KernelUnavailable(ValueError):
    """The configured kernel cannot run here: an unknown name, or ``allocator`` with an allocator that ships no
    attention of its own."""
