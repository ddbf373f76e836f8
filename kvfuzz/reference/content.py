"""What the K/V of every position is: a deterministic function of (namespace, token prefix), as in a causal model.

A position's **tag** is a 63-bit chained hash of the namespace and every token up to and including it. Its K and V
(and the query the engine attends with there) are generated from the tag alone, so any value found in a pool can be
traced back to the prefix that produced it by comparing tags, the way shadow memory traces a byte to its write.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Sequence

import attrs
import torch

from kvfuzz.allocator.types import Namespace

_MASK64 = (1 << 64) - 1
_TAG_MASK = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    return value - (1 << 64) if value >= 1 << 63 else value


_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_SALT_K, _SALT_V, _SALT_Q = _signed(0x2545F4914F6CDD1D), _signed(0x5851F42D4C957F2D), _signed(0x14057B7EF767814F)


def _splitmix(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def namespace_tag(namespace: Namespace) -> int:
    """The tag before the first token: part boundaries count, so ("ab", "c") and ("a", "bc") differ."""
    digest = hashlib.blake2b(repr(tuple(namespace)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _TAG_MASK


def extend_tag(tag: int, token: int) -> int:
    """The tag of a prefix extended by one token."""
    return _splitmix((tag * 31 + token) & _MASK64) & _TAG_MASK


def prefix_tags(namespace: Namespace, tokens: Iterable[int]) -> list[int]:
    """The tag of every position of ``tokens`` under ``namespace``."""
    tags, tag = [], namespace_tag(namespace)
    for token in tokens:
        tag = extend_tag(tag, token)
        tags.append(tag)
    return tags


@attrs.frozen
class ModelShape:
    """The shape of the model whose K/V the pools hold. Query heads are a multiple of KV heads (grouped queries)."""

    num_layers: int = 2
    num_kv_heads: int = 2
    num_query_heads: int = 4
    head_dim: int = 8
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    def __attrs_post_init__(self) -> None:
        if self.num_query_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_query_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but torch sees no CUDA device")

    @property
    def kv_row_shape(self) -> tuple[int, int, int]:
        """Shape of one position's K (or V): layers x KV heads x head dim."""
        return (self.num_layers, self.num_kv_heads, self.head_dim)


def _mix_tensor(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic, logical shifts)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def _values(tags: Sequence[int], salt: int, row_shape: tuple[int, ...], shape: ModelShape) -> torch.Tensor:
    """Values in [-1, 1) with 23 significant bits, one row of ``row_shape`` per tag, cast to the pool's dtype."""
    count = 1
    for dim in row_shape:
        count *= dim
    lanes = torch.arange(count, dtype=torch.int64) * _signed(_GOLDEN) + salt
    mixed = _mix_tensor(torch.tensor(list(tags), dtype=torch.int64).unsqueeze(1) ^ lanes)
    values = (mixed & 0xFFFFFF).to(torch.float32) / float(1 << 23) - 1.0
    return values.reshape(len(tags), *row_shape).to(device=shape.device, dtype=shape.dtype)


def kv_for_tags(tags: Sequence[int], shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the positions with these tags, each ``[len(tags), layers, kv_heads, head_dim]``."""
    return _values(tags, _SALT_K, shape.kv_row_shape, shape), _values(tags, _SALT_V, shape.kv_row_shape, shape)


def queries_for_tags(tags: Sequence[int], shape: ModelShape) -> torch.Tensor:
    """The query at each tagged position, ``[len(tags), layers, query_heads, head_dim]``."""
    return _values(tags, _SALT_Q, (shape.num_layers, shape.num_query_heads, shape.head_dim), shape)
