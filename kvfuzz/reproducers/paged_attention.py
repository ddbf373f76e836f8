"""Reproducers of traces of ``kvfuzz.adapters.torch_paged`` (PyTorch's
``torch.nn.attention.experimental._paged_attention.PagedAttention``, one sequence per batch index): a ``Session``
that makes the adapter's calls (``reserve`` at admission and growth, ``erase`` at a free or preemption) and, at each
step, states the attention check on torch's own objects: the mask ``convert_logical_block_mask`` builds for a running
sequence lets it attend exactly the physical slots its ``page_table`` row holds for its positions (flex_attention
applies that mask's ``mask_mod`` to every physical slot when it runs eagerly)."""

from __future__ import annotations

from kvfuzz.reproducers.program import NotReproducible
from kvfuzz.saved.trace import Trace

ADAPTER = "kvfuzz.adapters.torch_paged"
OPERATIONS = frozenset({"admit", "readmit", "grow", "free", "preempt", "step"})
ENGINE = "torch"


def key_of(namespace: tuple[str, ...]) -> object:
    """PagedAttention has no prefix cache, so no namespaces: the key is None."""
    if namespace:
        raise NotReproducible("a namespace: PagedAttention has no prefix cache to key")
    return None


def check(trace: Trace) -> None:
    """Every factory of the adapter is the one PagedAttention."""


def constants(trace: Trace) -> str:
    return f"PAGE_SIZE = {trace.config.block_size}\nNUM_PAGES = {trace.config.num_blocks}\n"


RUNTIME = r'''
# ---- torch's PagedAttention driven as its users' decode loops drive it (the same in every such reproducer) --------
import torch
from torch.nn.attention.experimental._paged_attention import PagedAttention
from torch.nn.attention.flex_attention import create_block_mask


class Session:
    """One PagedAttention over NUM_PAGES pages; each sequence takes the lowest free batch index."""

    def __init__(self):
        self.paged = PagedAttention(n_pages=NUM_PAGES, page_size=PAGE_SIZE, max_batch_size=NUM_PAGES, device="cpu")
        self.book = Book(PAGE_SIZE, lands_on_free=False, unit="page")
        self.batch = {}  # running sequence -> its batch index
        self.tokens = {}  # sequence -> its tokens (kept while preempted)

    def admit(self, seq, key, tokens):
        """The lowest free batch index; reserve the prompt's length."""
        batch = min(set(range(NUM_PAGES)) - set(self.batch.values()))
        try:
            self.paged.reserve(torch.tensor([batch]), torch.tensor([len(tokens)]))
        except AssertionError as refusal:
            if "empty pages" not in str(refusal):
                raise
            print(f"(admission of {seq} refused: {refusal})")
            return
        self.batch[seq], self.tokens[seq] = batch, list(tokens)
        self.book.schedule(seq, key, tokens, self.slots(seq), 0)

    def readmit(self, seq):
        self.admit(seq, None, self.tokens[seq])

    def grow(self, seq, tokens):
        old = len(self.tokens[seq])
        self.paged.reserve(torch.tensor([self.batch[seq]]), torch.tensor([old + len(tokens)]))
        self.tokens[seq] += list(tokens)
        self.book.schedule(seq, None, self.tokens[seq], self.slots(seq), old)

    def free(self, seq):
        self.paged.erase(torch.tensor([self.batch.pop(seq)]))
        del self.tokens[seq]
        self.book.freed(seq)

    def preempt(self, seq):
        self.paged.erase(torch.tensor([self.batch.pop(seq)]))
        self.book.withdraw(seq, f"the preemption of {seq}")

    def slots(self, seq):
        """(page, offset) of each of the sequence's positions, off its page_table row."""
        row = self.paged.page_table[self.batch[seq]].tolist()
        return [(row[position // PAGE_SIZE], position % PAGE_SIZE) for position in range(len(self.tokens[seq]))]

    def step(self):
        """The step writes the new K/V, then each running sequence attends over all its positions through the mask
        PagedAttention converts for its batch index."""
        self.book.completed()
        for seq, batch in sorted(self.batch.items()):
            length = len(self.tokens[seq])
            kv_len = torch.tensor([length])
            logical = create_block_mask(
                lambda b, h, q_idx, kv_idx: kv_idx < kv_len[b], B=1, H=None, Q_LEN=1,
                KV_LEN=-(-length // PAGE_SIZE) * PAGE_SIZE, BLOCK_SIZE=(1, PAGE_SIZE), device="cpu",
            )
            physical = self.paged.convert_logical_block_mask(logical, batch_idx=torch.tensor([batch]), kv_len=kv_len)
            zero = torch.tensor(0)
            attended = [
                slot for slot in range(NUM_PAGES * PAGE_SIZE)
                if bool(physical.mask_mod(zero, zero, zero, torch.tensor(slot)))
            ]
            expected = sorted(page * PAGE_SIZE + offset for page, offset in self.slots(seq))
            if attended != expected:
                extra = sorted(set(attended) - set(expected))
                pages = sorted({slot // PAGE_SIZE for slot in extra})
                stale = ", ".join(
                    f"page {page} to logical block {int(self.paged.physical_to_logical[batch, page])}" for page in pages
                )
                raise Failure(
                    f"attention at step {self.book.step - 1}: {seq} (batch index {batch}, {length} tokens, page table "
                    f"{self.paged.page_table[batch, : -(-length // PAGE_SIZE)].tolist()}) attends physical slots "
                    f"{extra or sorted(set(expected) - set(attended))} "
                    f"{'besides' if extra else 'missing from'} its own {expected}: "
                    f"physical_to_logical[{batch}] still maps {stale}, pages its page table does not hold"
                )
'''
