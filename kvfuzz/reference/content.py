"""What the K/V of every position is: a deterministic function of (namespace, token prefix), as in a causal model.

A position's **tag** is a 63-bit chained hash of the namespace and every token up to and including it. Its K and V
(and the query the engine attends with there) are generated from the tag alone, so any value found in a pool can be
traced back to the prefix that produced it by comparing tags, the way shadow memory traces a byte to its write.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Hashable, Iterable, Sequence

import attrs
import numpy
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


def namespace_tag(namespace: Namespace) -> int:
    """The tag before the first token: part boundaries count, so ("ab", "c") and ("a", "bc") differ."""
    return _namespace_tag(tuple(namespace))


@functools.lru_cache(maxsize=1024)
def _namespace_tag(namespace: tuple[str, ...]) -> int:
    """:func:`namespace_tag`, made once per namespace (a hash of its parts)."""
    digest = hashlib.blake2b(repr(namespace).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _TAG_MASK


def extend_tag(tag: int, token: int) -> int:
    """The tag of a prefix extended by one token: SplitMix64's finalizer over ``(tag * 31 + token) mod 2**64``, 63
    bits of it."""
    x = (((tag * 31 + token) & _MASK64) + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & _TAG_MASK


def prefix_tags(namespace: Namespace, tokens: Iterable[int]) -> list[int]:
    """The tag of every position of ``tokens`` under ``namespace``."""
    tags: list[int] = []
    _extend_tags(tags, namespace_tag(namespace), tokens)
    return tags


def _extend_tags(tags: list[int], tag: int, tokens: Iterable[int]) -> None:
    """Append to ``tags`` the tag of each of ``tokens``, the prefix before them having tag ``tag``."""
    for token in tokens:
        tag = extend_tag(tag, token)
        tags.append(tag)


class TagMemo:
    """The tags of the last token sequence asked for under each key (a request and its namespace, say), so that a
    sequence that grows step by step has only its new positions' tags computed.

    Invariant kept: for every key, ``tags`` is :func:`prefix_tags` of ``namespace`` over ``tokens`` as held. A
    sequence asked for is compared with the held one (in C, a list comparison): its held prefix is reused, anything
    else computed afresh. The lists returned are copies."""

    def __init__(self) -> None:
        # key -> (namespace, the longest tokens asked for under it lately, their tags)
        self._held: dict[Hashable, tuple[tuple[str, ...], list[int], list[int]]] = {}

    def tags(self, key: Hashable, namespace: tuple[str, ...], tokens: list[int]) -> list[int]:
        """:func:`prefix_tags` of ``namespace`` over ``tokens``."""
        held = self._held.get(key)
        count = len(tokens)
        if held is not None and held[0] == namespace:
            known, tags = held[1], held[2]
            if count <= len(known):
                if known[:count] == tokens:
                    return tags[:count]
            elif tokens[: len(known)] == known:
                _extend_tags(tags, tags[-1] if tags else namespace_tag(namespace), tokens[len(known) :])
                known.extend(tokens[len(known) :])
                return tags[:]
        tags = prefix_tags(namespace, tokens)
        self._held[key] = (namespace, list(tokens), tags)
        return tags[:]


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


def _mix(x: numpy.ndarray) -> numpy.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic, logical shifts), in place on ``x``. NumPy
    rather than torch: the same bits (uint64 wraps as torch's int64 does), a few microseconds less per operation."""
    x ^= x >> numpy.uint64(30)
    x *= numpy.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> numpy.uint64(27)
    x *= numpy.uint64(0x94D049BB133111EB)
    x ^= x >> numpy.uint64(31)
    return x


@functools.lru_cache(maxsize=None)
def _lanes(salts: tuple[int, ...], count: int) -> numpy.ndarray:
    """Each salt's ``count`` lane offsets, one salt after the other, as uint64: ``[len(salts) * count]`` (made once
    per shape, since every batch of rows uses the same)."""
    lane = numpy.arange(count, dtype=numpy.uint64) * numpy.uint64(_GOLDEN)
    return numpy.concatenate([lane + numpy.uint64(salt & _MASK64) for salt in salts])


def _values(tags: Sequence[int], salts: tuple[int, ...], row_shape: tuple[int, ...], shape: ModelShape) -> torch.Tensor:
    """Values in [-1, 1) with 23 significant bits, ``[len(tags), len(salts), *row_shape]``: for each tag, one row
    of ``row_shape`` per salt, cast to the pool's dtype. One batch of array operations serves every salt."""
    count = 1
    for dim in row_shape:
        count *= dim
    mixed = _mix(numpy.array(tags, dtype=numpy.uint64)[:, None] ^ _lanes(salts, count))
    values = (mixed & numpy.uint64(0xFFFFFF)).astype(numpy.float32)
    values *= numpy.float32(1.0 / float(1 << 23))
    values -= numpy.float32(1.0)
    return (
        torch.from_numpy(values).reshape(len(tags), len(salts), *row_shape).to(device=shape.device, dtype=shape.dtype)
    )


class _RowTable:
    """The rows :func:`_values` already generated for one shape and set of salts, so that a tag's K/V (written by a
    step, read back by the checks, extended into the reference) is generated once, then copied out.

    Invariant kept: ``rows[index[tag]]`` equals ``_values([tag], salts, ...)[0]`` bit for bit. The table holds at
    most ``CAPACITY`` tags; when a batch would overflow it, it starts afresh."""

    CAPACITY = 1 << 15

    def __init__(self, salts: tuple[int, ...], row_shape: tuple[int, ...], shape: ModelShape) -> None:
        self.salts = salts  # one row per salt for every tag
        self.row_shape = row_shape  # the shape of one row
        self.shape = shape  # dtype and device of the rows
        self.index: dict[int, int] = {}  # tag -> its row in ``rows``
        self.rows = torch.empty((0, len(salts), *row_shape), dtype=shape.dtype, device=shape.device)

    def lookup(self, tags: Sequence[int]) -> torch.Tensor:
        """``[len(tags), len(salts), *row_shape]``, a new tensor (never a view of the table)."""
        if not self._hold(tags):
            return _values(tags, self.salts, self.row_shape, self.shape)
        index = self.index
        return self.rows[torch.tensor([index[tag] for tag in tags], dtype=torch.int64, device=self.rows.device)]

    def padded(self, tag_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        """``[len(tag_lists), longest, len(salts), *row_shape]``: each list's rows, then zeros up to the longest (one
        index of the table for the whole batch)."""
        tags = [tag for tag_list in tag_lists for tag in tag_list]
        lengths = [len(tag_list) for tag_list in tag_lists]
        longest = max(lengths, default=0)
        if not self._hold(tags):
            rows = [_values(tag_list, self.salts, self.row_shape, self.shape) for tag_list in tag_lists]
            return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        index = self.index
        positions = [[index[tag] for tag in tag_list] + [0] * (longest - len(tag_list)) for tag_list in tag_lists]
        found = self.rows[torch.tensor(positions, dtype=torch.int64, device=self.rows.device)]
        valid = torch.arange(longest).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
        mask = valid.to(self.rows.device).reshape(len(tag_lists), longest, *(1,) * (found.dim() - 2))
        return torch.where(mask, found, 0)

    def _hold(self, tags: Sequence[int]) -> bool:
        """Generate the rows of those ``tags`` the table lacks; False (the table unchanged) when they are more
        than it can hold."""
        index = self.index
        missing = [tag for tag in dict.fromkeys(tags) if tag not in index]
        if len(missing) > self.CAPACITY:
            return False
        if missing:
            if len(index) + len(missing) > self.CAPACITY:
                index.clear()
                missing = list(dict.fromkeys(tags))
            start = len(index)
            needed = start + len(missing)
            if needed > len(self.rows):
                grown = torch.empty(
                    (min(self.CAPACITY, max(needed, 2 * len(self.rows), 256)), *self.rows.shape[1:]),
                    dtype=self.rows.dtype,
                    device=self.rows.device,
                )
                grown[:start] = self.rows[:start]
                self.rows = grown
            self.rows[start:needed] = _values(missing, self.salts, self.row_shape, self.shape)
            index.update(zip(missing, range(start, needed)))
        return True


_TABLES: dict[tuple[ModelShape, tuple[int, ...]], _RowTable] = {}  # (shape, salts) -> the rows generated so far


def _table(salts: tuple[int, ...], row_shape: tuple[int, ...], shape: ModelShape) -> _RowTable:
    table = _TABLES.get((shape, salts))
    if table is None:
        table = _TABLES[(shape, salts)] = _RowTable(salts, row_shape, shape)
    return table


def _rows(tags: Sequence[int], salts: tuple[int, ...], row_shape: tuple[int, ...], shape: ModelShape) -> torch.Tensor:
    return _table(salts, row_shape, shape).lookup(tags)


def kv_for_tags(tags: Sequence[int], shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the positions with these tags, each ``[len(tags), layers, kv_heads, head_dim]``."""
    both = _rows(tags, (_SALT_K, _SALT_V), shape.kv_row_shape, shape)
    return both[:, 0], both[:, 1]


def padded_kv_for_tags(tag_lists: Sequence[Sequence[int]], shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of several lists of tagged positions, each ``[len(tag_lists), longest, layers, kv_heads, head_dim]``,
    zero past each list's end (what ``pad_sequence`` makes of each list's :func:`kv_for_tags`, bit for bit)."""
    both = _table((_SALT_K, _SALT_V), shape.kv_row_shape, shape).padded(tag_lists)
    return both[:, :, 0].contiguous(), both[:, :, 1].contiguous()


def queries_for_tags(tags: Sequence[int], shape: ModelShape) -> torch.Tensor:
    """The query at each tagged position, ``[len(tags), layers, query_heads, head_dim]``."""
    return _rows(tags, (_SALT_Q,), (shape.num_layers, shape.num_query_heads, shape.head_dim), shape)[:, 0]
