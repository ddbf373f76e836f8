"""Attention through the worker's tables, with the reference beside it (invariant 2 for a real scheduler).

After a step's writes, every scheduled token of every request attends, causally, to its request's positions ``0 .. p``
(the context length ``p + 1``; in a sliding-window KV-cache group of ``W`` tokens only ``p - W + 1 .. p``, in a chunked-
local group of chunks of ``C`` tokens ``p // C * C .. p``), in each KV-cache group, read through the request's block
table of that group from the paged pools, with the query kvfuzz derives from the token's prefix
(:func:`~kvfuzz.reference.content.queries_for_tags`). The reference attends the same query over the request's own
contiguous K/V (:func:`~kvfuzz.reference.content.padded_kv_for_tags` of its own tokens), with
:func:`kvfuzz.reference.attention.attend`. The two must agree: bit for bit for the ``gather`` kernel (the reference's
own function on the gathered K/V), within the kernel's stated tolerance for another (``vllm-triton``: vLLM's Triton
unified attention in Triton's interpreter). The content check already compares every attended position's K/V bit for
bit; this adds the kernel's read path: the block table's indexing and the context lengths it is given.

Checks are types: :class:`NoAttention` (``off``) computes nothing, :class:`KernelAttention` runs a kernel of
:mod:`kvfuzz.kernels`."""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import attrs
import torch

from kvfuzz.kernels.base import AttentionKernel, PagedBatch, compare
from kvfuzz.reference.attention import attend
from kvfuzz.reference.content import padded_kv_for_tags, prefix_tags, queries_for_tags
from kvfuzz.scheduler.config import MODEL_SHAPE
from kvfuzz.scheduler.groups import GroupRule
from kvfuzz.scheduler.violations import Check, SchedulerViolation


@attrs.frozen
class Attending:
    """A scheduled request's view for attention in one KV-cache group: its tokens, its block table there and the
    positions it computed this step (each attends to every position up to it, or within the group's window)."""

    request: str
    tokens: tuple[int, ...]  # every token the worker knows for the request
    table: tuple[int, ...]  # its block ids in the group, in position order
    positions: range  # the positions scheduled this step
    namespace: tuple[str, ...] = ()  # its K/V tags' namespace in the group (the group's, then its cache salt's)
    rule: GroupRule = GroupRule(0, None)  # the group's: which positions a token attends (full attention by default)
    group: str = ""  # `` in group N (its kind)`` where the model has several groups, for messages

    def first_attended(self, position: int) -> int:
        """The first position the token at ``position`` attends to: 0, the start of its window, or of its chunk."""
        return self.rule.first_needed(position)


class PagedContents(Protocol):
    """The paged pools a kernel reads: the worker's :class:`~kvfuzz.scheduler.kv_slots.SlotPool`."""

    def contents(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every slot, ``[slots, layers, kv_heads, head_dim]`` each."""


class AttentionCheck(Protocol):
    """Computes the step's attention through the tables and compares it with the reference."""

    name: str

    def views(self, build: Callable[[], list[Attending]]) -> Sequence[Attending]:
        """The step's views this check reads, built by ``build`` (with the tables and tokens as the step wrote
        them, before its sampled tokens join them) only where the check reads any."""

    def check(self, attending: Sequence[Attending], pool: PagedContents, step: int) -> None:
        """Raise :class:`SchedulerViolation` (``attention``) where the paged result differs from the reference."""


class NoAttention:
    """No attention computed (the content check alone)."""

    name = "off"

    def views(self, build: Callable[[], list[Attending]]) -> Sequence[Attending]:
        return ()

    def check(self, attending: Sequence[Attending], pool: PagedContents, step: int) -> None:
        return None


class KernelAttention:
    """Attention of every scheduled token through a kernel of :mod:`kvfuzz.kernels`, against the reference."""

    def __init__(self, kernel: AttentionKernel, block_size: int) -> None:
        self.kernel = kernel  # the paged side
        self.block_size = block_size  # slots per block of the pools
        self.name = kernel.name

    def views(self, build: Callable[[], list[Attending]]) -> Sequence[Attending]:
        return build()

    def context_length(self, position: int) -> int:
        """How many positions the token at ``position`` attends to (causal: itself and every one before it)."""
        return position + 1

    def check(self, attending: Sequence[Attending], pool: PagedContents, step: int) -> None:
        rows = [(view, position) for view in range(len(attending)) for position in attending[view].positions]
        if not rows:
            return
        tags = [prefix_tags(request.namespace, request.tokens) for request in attending]
        starts = [attending[view].first_attended(position) for view, position in rows]
        lengths = [self.context_length(position) for _, position in rows]
        queries = queries_for_tags([tags[view][position] for view, position in rows], MODEL_SHAPE)
        keys, values = pool.contents()
        batch = PagedBatch(
            seqs=[f"{attending[view].request}@{position}" for view, position in rows],
            tables=[attending[view].table for view, _ in rows],
            starts=starts,
            lengths=lengths,
            queries=queries,
            keys=keys,
            values=values,
            block_size=self.block_size,
        )
        paged = self.kernel.attend(batch)
        own = [tags[view][start : position + 1] for (view, position), start in zip(rows, starts)]
        own_keys, own_values = padded_kv_for_tags(own, MODEL_SHAPE)
        expected = attend(queries, own_keys, own_values, torch.tensor([len(prefix) for prefix in own]))
        mismatch = compare(paged, expected, self.kernel.tolerance(MODEL_SHAPE.dtype))
        if mismatch is None:
            return
        view, position = rows[mismatch.row]
        request, start = attending[view], starts[mismatch.row]
        read = f"context length {lengths[mismatch.row]}" if start == 0 else f"from position {start}"
        tolerance = self.kernel.tolerance(MODEL_SHAPE.dtype)
        raise SchedulerViolation(
            Check.ATTENTION,
            step,
            request.request,
            f"the attention of its position {position} through its table {list(request.table)}{request.group} "
            f"({self.name} kernel, {read}) differs from the reference over its own {position + 1 - start} positions' "
            f"K/V by up to {mismatch.max_abs_diff:.3g} (allowed: "
            + ("none, bit for bit" if tolerance is None else str(tolerance))
            + ")",
            f"the {self.name} kernel's attention",
        )


AttentionFactory = Callable[[int], AttentionCheck]
"""Builds the attention check for pools of a block size."""


def _gather(block_size: int) -> AttentionCheck:
    from kvfuzz.kernels.gather import GatherKernel

    return KernelAttention(GatherKernel(), block_size)


def _vllm_triton(block_size: int) -> AttentionCheck:
    from kvfuzz.kernels.vllm_triton import VllmTritonKernel

    return KernelAttention(VllmTritonKernel(MODEL_SHAPE), block_size)


ATTENTIONS: dict[str, AttentionFactory] = {
    "off": lambda _block_size: NoAttention(),
    "gather": _gather,
    "vllm-triton": _vllm_triton,
}
"""The attention checks ``kvfuzz run --scheduler --attention`` names."""
