"""The naive contiguous reference: each sequence's K and V as plain tensors, never paged, never shared.

It is the oracle the paged pools are checked against. Its tensors always hold the K/V of every token the sequence
has, in order: ``keys(seq)[p]`` is the K of (namespace, tokens[0..p]). They are made from the sequence's tags when
asked for (by attention, once per step, for the whole batch), not kept: a position's K/V is a function of its tag
alone, so the tags are the whole of a sequence's contiguous state.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import attrs
import torch

from kvfuzz.allocator.types import Namespace, SeqId
from kvfuzz.reference.attention import attend
from kvfuzz.reference.content import (
    ModelShape,
    extend_tag,
    kv_for_tags,
    namespace_tag,
    padded_kv_for_tags,
    prefix_tags,
    queries_for_tags,
)


@attrs.define
class _Contiguous:
    """One sequence: its namespace, tokens and per-position tags (``tags[p]`` is the tag of ``tokens[: p + 1]``)."""

    namespace: Namespace
    tokens: list[int]
    tags: list[int]


def _unheard(seq: SeqId) -> None:
    """``on_change`` until someone listens."""


class ContiguousReference:
    """Per-sequence contiguous K/V and attention. Every change of a sequence's tokens (``add``, ``extend``, ``fork``'s
    child, ``truncate``, ``remove``) goes through ``on_change`` with the sequence's id: the engine's expected state
    keeps its indexes of the sequences by it."""

    def __init__(self, shape: ModelShape) -> None:
        self.shape = shape
        self._seqs: dict[SeqId, _Contiguous] = {}
        self.on_change: Callable[[SeqId], None] = _unheard  # told the id of every sequence whose tokens change

    def __contains__(self, seq: SeqId) -> bool:
        return seq in self._seqs

    def add(self, seq: SeqId, namespace: Namespace, tokens: Sequence[int]) -> None:
        self._seqs[seq] = _Contiguous(namespace, list(tokens), prefix_tags(namespace, tokens))
        self.on_change(seq)

    def extend(self, seq: SeqId, tokens: Iterable[int]) -> list[int]:
        """Append tokens; returns their tags."""
        state = self._seqs[seq]
        tag = state.tags[-1] if state.tags else namespace_tag(state.namespace)
        new_tags = []
        for token in tokens:
            tag = extend_tag(tag, token)
            new_tags.append(tag)
            state.tokens.append(token)
        state.tags.extend(new_tags)
        self.on_change(seq)
        return new_tags

    def fork(self, parent: SeqId, child: SeqId) -> None:
        source = self._seqs[parent]
        self._seqs[child] = _Contiguous(source.namespace, list(source.tokens), list(source.tags))
        self.on_change(child)

    def truncate(self, seq: SeqId, length: int) -> None:
        state = self._seqs[seq]
        del state.tokens[length:], state.tags[length:]
        self.on_change(seq)

    def remove(self, seq: SeqId) -> None:
        del self._seqs[seq]
        self.on_change(seq)

    def namespace(self, seq: SeqId) -> Namespace:
        return self._seqs[seq].namespace

    def tokens(self, seq: SeqId) -> list[int]:
        return self._seqs[seq].tokens

    def tags(self, seq: SeqId) -> list[int]:
        return self._seqs[seq].tags

    def keys(self, seq: SeqId) -> torch.Tensor:
        return kv_for_tags(self._seqs[seq].tags, self.shape)[0]

    def values(self, seq: SeqId) -> torch.Tensor:
        return kv_for_tags(self._seqs[seq].tags, self.shape)[1]

    def queries(self, seqs: Sequence[SeqId]) -> torch.Tensor:
        """The query of each sequence's last token, ``[S, L, Hq, D]``."""
        return queries_for_tags([self._seqs[seq].tags[-1] for seq in seqs], self.shape)

    def attention(
        self, seqs: Sequence[SeqId], queries: torch.Tensor, starts: Optional[Sequence[int]] = None
    ) -> torch.Tensor:
        """Attention of ``queries`` over each sequence's contiguous K/V from ``starts`` (a sliding window) on,
        padded with zeros to the longest (:meth:`windows`)."""
        keys, values, lengths = self.windows(seqs, starts)
        return attend(queries, keys, values, torch.tensor(lengths))

    def windows(
        self, seqs: Sequence[SeqId], starts: Optional[Sequence[int]] = None
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Each sequence's K and V from ``starts`` on, ``[S, N, L, Hkv, D]`` padded with zeros to the longest window
        (made from their tags in one batch), and each window's length."""
        starts = starts or [0] * len(seqs)
        windows = [self._seqs[seq].tags[start:] for seq, start in zip(seqs, starts)]
        keys, values = padded_kv_for_tags(windows, self.shape)
        return keys, values, [len(window) for window in windows]
