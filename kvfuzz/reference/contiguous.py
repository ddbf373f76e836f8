"""The naive contiguous reference: one plain K and one plain V tensor per sequence, never paged, never shared.

It is the oracle the paged pools are checked against. Its tensors always hold the K/V of every token the sequence
has, in order: ``keys(seq)[p]`` is the K of (namespace, tokens[0..p]).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import attrs
import torch
from torch.nn.utils.rnn import pad_sequence

from kvfuzz.allocator.types import Namespace, SeqId
from kvfuzz.reference.attention import attend
from kvfuzz.reference.content import ModelShape, extend_tag, kv_for_tags, namespace_tag, prefix_tags, queries_for_tags


@attrs.define
class _Contiguous:
    """One sequence: its namespace, tokens, per-position tags and contiguous K/V ``[n, L, Hkv, D]``."""

    namespace: Namespace
    tokens: list[int]
    tags: list[int]
    keys: torch.Tensor
    values: torch.Tensor


class ContiguousReference:
    """Per-sequence contiguous K/V and attention."""

    def __init__(self, shape: ModelShape) -> None:
        self.shape = shape
        self._seqs: dict[SeqId, _Contiguous] = {}

    def __contains__(self, seq: SeqId) -> bool:
        return seq in self._seqs

    def add(self, seq: SeqId, namespace: Namespace, tokens: Sequence[int]) -> None:
        tags = prefix_tags(namespace, tokens)
        keys, values = kv_for_tags(tags, self.shape)
        self._seqs[seq] = _Contiguous(namespace, list(tokens), tags, keys, values)

    def extend(self, seq: SeqId, tokens: Iterable[int]) -> list[int]:
        """Append tokens; returns their tags."""
        state = self._seqs[seq]
        tag = state.tags[-1] if state.tags else namespace_tag(state.namespace)
        new_tags = []
        for token in tokens:
            tag = extend_tag(tag, token)
            new_tags.append(tag)
            state.tokens.append(token)
        keys, values = kv_for_tags(new_tags, self.shape)
        state.tags.extend(new_tags)
        state.keys = torch.cat([state.keys, keys])
        state.values = torch.cat([state.values, values])
        return new_tags

    def fork(self, parent: SeqId, child: SeqId) -> None:
        source = self._seqs[parent]
        self._seqs[child] = _Contiguous(
            source.namespace, list(source.tokens), list(source.tags), source.keys, source.values
        )

    def truncate(self, seq: SeqId, length: int) -> None:
        state = self._seqs[seq]
        del state.tokens[length:], state.tags[length:]
        state.keys, state.values = state.keys[:length], state.values[:length]

    def remove(self, seq: SeqId) -> None:
        del self._seqs[seq]

    def namespace(self, seq: SeqId) -> Namespace:
        return self._seqs[seq].namespace

    def tokens(self, seq: SeqId) -> list[int]:
        return self._seqs[seq].tokens

    def tags(self, seq: SeqId) -> list[int]:
        return self._seqs[seq].tags

    def keys(self, seq: SeqId) -> torch.Tensor:
        return self._seqs[seq].keys

    def values(self, seq: SeqId) -> torch.Tensor:
        return self._seqs[seq].values

    def queries(self, seqs: Sequence[SeqId]) -> torch.Tensor:
        """The query of each sequence's last token, ``[S, L, Hq, D]``."""
        return queries_for_tags([self._seqs[seq].tags[-1] for seq in seqs], self.shape)

    def attention(
        self, seqs: Sequence[SeqId], queries: torch.Tensor, starts: Optional[Sequence[int]] = None
    ) -> torch.Tensor:
        """Attention of ``queries`` over each sequence's contiguous K/V from ``starts`` (a sliding window) on,
        padded with zeros to the longest (one ``pad_sequence`` call, not a copy per sequence)."""
        starts = starts or [0] * len(seqs)
        lengths = [len(self._seqs[seq].tags) - start for seq, start in zip(seqs, starts)]
        states = [self._seqs[seq] for seq in seqs]
        keys = pad_sequence([state.keys[start:] for state, start in zip(states, starts)], batch_first=True)
        values = pad_sequence([state.values[start:] for state, start in zip(states, starts)], batch_first=True)
        return attend(queries, keys, values, torch.tensor(lengths))
