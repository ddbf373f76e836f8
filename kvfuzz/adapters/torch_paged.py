"""PyTorch's own paged attention behind the kvfuzz contract:
``torch.nn.attention.experimental._paged_attention.PagedAttention`` (torch 2.5+), driven the way its users drive it.

``kvfuzz run --allocator kvfuzz.adapters.torch_paged:paged_attention --kernel allocator``

How the contract maps onto it (one sequence = one batch index, as in its users' decode loops):

* admit -> take the lowest free batch index, ``reserve(batch_idx, len(prompt))``; grow -> ``reserve`` the new
  length; free -> ``erase(batch_idx)`` and release the index; preempt -> ``erase`` too (the engine re-admits the
  sequence later, recomputing it). A sequence's block table is its ``page_table`` row up to its ``capacity``.
* ``reserve`` refuses with ``AssertionError("requested N pages but there are only M empty pages")`` before it
  changes anything; the adapter reports that as :class:`OutOfBlocks`.
* K/V: ``PagedAttention.assign`` writes a batch's new K/V at ``page_table[b, pos // page_size] * page_size +
  pos % page_size`` of a cache ``[1, H, n_pages * page_size, D]``. kvfuzz's engine writes exactly those slots of its
  own pools, so its pools are the physical page store ``assign`` would fill.
* Attention (``capabilities.attention_kernel``): a logical block mask from ``create_block_mask`` (positions
  ``start .. len - 1`` of each row: causal for the last token, and a sliding window's start),
  ``convert_logical_block_mask(mask, batch_idx, kv_len)``, then ``flex_attention`` over the physical pools with
  ``enable_gqa`` -- the path its docstring describes. It runs eagerly, as flex_attention does without compile.
* Not supported, declared so: fork and copy-on-write, prefix caching and namespaces, swap, eviction (no page
  outlives its batch), rollback (``reserve`` only grows; erasing and reserving again would hand out other pages
  and lose the kept K/V), and no in-flight window (W = 0: ``erase`` returns pages to ``empty_pages`` at once).
* Introspection: refcount = how many ``page_table`` entries name the page; the free set is ``empty_pages`` itself
  (a list, so a page erased twice would show twice); nothing is cached or pending.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvfuzz.adapters.base import SequenceLedger
from kvfuzz.allocator.errors import OutOfBlocks
from kvfuzz.allocator.types import (
    AdmitResult,
    Capabilities,
    GrowResult,
    Namespace,
    PoolSpec,
    SeqId,
    Slot,
    Tokens,
)
from kvfuzz.kernels.flex import eager_flex_attention, pool_as_heads

CODE_UNDER_TEST = ("torch", ("nn/attention/experimental/_paged_attention.py",))
"""What a campaign's --coverage measures of this adapter's allocator: PyTorch's experimental PagedAttention
(kvfuzz.coverage.scope)."""

_EXHAUSTED = "empty pages"
"""The words of ``PagedAttention.reserve``'s refusal for lack of pages."""


class TorchPagedAttention:
    """kvfuzz's contract over one ``PagedAttention``.

    Invariant: ``batch_of`` maps every running sequence (``sequences``) to its own batch index, and ``length`` holds
    its token count; every other batch index has been erased (or never reserved).
    """

    # PagedAttention has no page sharing (no fork), no host pool (no swap), its reserve only grows a batch's capacity
    # (no rollback), and it caches nothing (no eviction): none of those methods exists.
    capabilities = Capabilities(introspection=True, attention_kernel=True)
    num_host_blocks = 0

    def __init__(self, spec: PoolSpec) -> None:
        from torch.nn.attention.experimental._paged_attention import PagedAttention

        self.block_size = spec.block_size
        self.num_blocks = spec.num_blocks
        # Every live sequence holds at least one page, so there are never more live sequences than pages.
        self.max_batch_size = spec.num_blocks
        self.paged = PagedAttention(
            n_pages=spec.num_blocks, page_size=spec.block_size, max_batch_size=self.max_batch_size, device="cpu"
        )
        self.sequences = SequenceLedger()  # the sequences held and their phases; raises the misuse errors
        self.batch_of: dict[SeqId, int] = {}  # running sequence -> its batch index
        self.length: dict[SeqId, int] = {}  # running sequence -> its token count

    # -- the contract ------------------------------------------------------------------------------------------

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        self.sequences.check_admit(seq, tokens)
        in_use = set(self.batch_of.values())
        batch = next((index for index in range(self.max_batch_size) if index not in in_use), None)
        if batch is None:
            raise OutOfBlocks(
                f"admit: every one of the {self.max_batch_size} batch indices is in use", needed=1, available=0
            )
        self._reserve(f"admit of {seq}", batch, len(tokens))
        self.batch_of[seq], self.length[seq] = batch, len(tokens)
        self.sequences.admitted(seq)
        return AdmitResult(self.block_table(seq), 0)

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        self.sequences.running(seq, "grow")
        self.sequences.check_tokens("grow", seq, tokens)
        batch = self.batch_of[seq]
        old = self.length[seq]
        self._reserve(f"grow of {seq}", batch, old + len(tokens))
        self.length[seq] = old + len(tokens)
        row = self.paged.page_table[batch].tolist()
        size = self.block_size
        return GrowResult([Slot(row[p // size], p % size) for p in range(old, old + len(tokens))])

    def free(self, seq: SeqId) -> None:
        self.sequences.live(seq, "free")
        self._erase(seq)
        self.sequences.freed(seq)

    def preempt(self, seq: SeqId) -> None:
        self.sequences.running(seq, "preempt")
        self._erase(seq)
        self.sequences.preempted(seq)

    def library_block_name(self, block: int) -> str:
        """Block ``block`` as PyTorch numbers it (the same: its page index), for ``kvfuzz show``."""
        return f"PagedAttention page {block}"

    def block_table(self, seq: SeqId) -> tuple[int, ...]:
        self.sequences.running(seq, "block_table")
        batch = self.batch_of[seq]
        pages = int(self.paged.capacity[batch]) // self.block_size
        return tuple(self.paged.page_table[batch, :pages].tolist())

    def step_completed(self, step: int) -> None:
        """Nothing to do: ``erase`` frees pages at once (W = 0)."""

    # -- introspection -----------------------------------------------------------------------------------------

    def refcount(self, block: int) -> int:
        return int((self.paged.page_table == block).sum())

    def free_blocks(self) -> list[int]:
        return self.paged.empty_pages

    def cached_blocks(self) -> tuple[int, ...]:
        return ()

    def pending_blocks(self) -> tuple[int, ...]:
        return ()

    # -- its own paged attention -------------------------------------------------------------------------------

    def paged_attention(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        seqs: Sequence[SeqId],
        lengths: Sequence[int],
        starts: Sequence[int],
    ) -> torch.Tensor:
        """Decode attention as PagedAttention's users run it: a logical block mask, converted to physical pages
        through the page table for these sequences' batch indices, then flex_attention over the physical pools."""
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        rows, layers, query_heads, dim = queries.shape
        for seq in seqs:
            self.sequences.running(seq, "paged_attention")
        batch_idx = torch.tensor([self.batch_of[seq] for seq in seqs])
        kv_len = torch.tensor(list(lengths))
        first = torch.tensor(list(starts))

        def logical_mask(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return (kv_idx >= first[b]) & (kv_idx < kv_len[b])

        size = self.block_size
        logical = create_block_mask(
            logical_mask,
            B=rows,
            H=None,
            Q_LEN=1,
            KV_LEN=-(-max(lengths) // size) * size,
            BLOCK_SIZE=(1, size),
            device="cpu",
        )
        physical = self.paged.convert_logical_block_mask(logical, batch_idx=batch_idx, kv_len=kv_len)
        with eager_flex_attention():
            out = flex_attention(
                queries.reshape(rows, layers * query_heads, 1, dim),
                pool_as_heads(keys),
                pool_as_heads(values),
                block_mask=physical,
                enable_gqa=True,
            )
        return out.reshape(rows, layers, query_heads, dim)

    # -- helpers -----------------------------------------------------------------------------------------------

    def _reserve(self, what: str, batch: int, length: int) -> None:
        try:
            self.paged.reserve(torch.tensor([batch]), torch.tensor([length]))
        except AssertionError as error:
            if _EXHAUSTED not in str(error):
                raise
            held = int(self.paged.capacity[batch]) // self.block_size
            raise OutOfBlocks(
                f"{what} (batch index {batch}, {length} tokens): PagedAttention.reserve refused: {error}",
                needed=-(-length // self.block_size) - held,
                available=len(self.paged.empty_pages),
            ) from error

    def _erase(self, seq: SeqId) -> None:
        self.paged.erase(torch.tensor([self.batch_of.pop(seq)]))
        del self.length[seq]


def paged_attention(spec: PoolSpec) -> TorchPagedAttention:
    """The factory: ``kvfuzz run --allocator kvfuzz.adapters.torch_paged:paged_attention``."""
    return TorchPagedAttention(spec)
