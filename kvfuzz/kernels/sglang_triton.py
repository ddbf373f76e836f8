"""SGLang's Triton attention kernels as invariant 2's paged side: ``decode_attention_fwd`` and
``extend_attention_fwd`` from the installed SGLang (``sglang.kernels.ops.attention``), nothing copied.

SGLang addresses K/V by token slot: its ``ReqToTokenPool`` holds, per request, the pool slot of every position
(``req_to_token``), and its Triton backend gathers a flat ``kv_indices`` stream out of it (one run of slots per
request, delimited by ``kv_indptr``) with its own ``create_flashinfer_kv_indices_triton``, starting at the sliding
window's first position where there is one (as its ``update_sliding_window_buffer`` does). This module builds
``req_to_token`` from kvfuzz's block tables (position ``p`` of row ``i`` at ``table[p // size_i] * block_size +
p % size_i``, :meth:`PagedBatch.slots`) and lets SGLang's code do the rest. Each layer's pools are passed as the
strided views ``keys[:, layer]`` ``[slots, Hkv, D]`` of the engine's pools, never copies; the scale is
``head_dim ** -0.5``, the reference's; query head ``h`` reads KV head ``h // (Hq / Hkv)``, the reference's grouping
and SGLang's.

Both kernels run every step, on a deterministic split of the rows by length (:func:`uses_extend`):

* the decode kernel, for rows of odd length: the query attends over ``kv_indices`` of positions ``start ..
  length - 1`` (split-KV, :data:`MAX_KV_SPLITS` splits of 32-token multiples, then SGLang's reduction);
* the extend kernel, for rows of even length: the last token is the one-token "extend" chunk (its query, and its
  K/V read out of the pools at its slot), positions ``start .. length - 2`` are the cached prefix read through
  ``kv_indices``, causal.

A sequence grows by one token per step, so each one meets both kernels in turn.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, Callable, NamedTuple

import numpy
import torch

from kvfuzz.kernels.base import PagedBatch, Tolerance, different_kernel_tolerance
from kvfuzz.kernels.triton_setup import import_engine_module, interpret_on_cpu
from kvfuzz.reference.content import ModelShape

NAME = "sglang-triton"

MAX_KV_SPLITS = 8
"""Splits of the decode kernel's KV: SGLang's default ``--triton-attention-num-kv-splits``, used for every row (as
its backend does when the split count is static)."""


def uses_extend(length: int) -> bool:
    """Whether a row of ``length`` positions runs the extend kernel (even lengths) rather than the decode kernel."""
    return length % 2 == 0


def req_to_token(batch: PagedBatch) -> torch.Tensor:
    """``[S, max length]`` int64: row i's pool slot of each position it reads (SGLang's ``req_to_token`` layout);
    positions before the window's start and past the row's length hold 0 and are never read."""
    table = torch.zeros((len(batch.seqs), max(batch.lengths)), dtype=torch.int64)
    for row, (start, length) in enumerate(zip(batch.starts, batch.lengths)):
        table[row, start:length] = torch.tensor(batch.slots(row), dtype=torch.int64)
    return table


def indptr(lengths: list[int]) -> torch.Tensor:
    """SGLang's ``*_indptr``: ``[n + 1]`` int32 offsets of n consecutive runs of the given lengths."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return offsets


class RowsFor(NamedTuple):
    """The rows one kernel runs, and the KV each reads through ``kv_indices``."""

    rows: list[int]  # batch rows, in order
    kv_starts: list[int]  # per row, the first position read through kv_indices
    kv_lens: list[int]  # per row, how many positions are read through kv_indices


def split(batch: PagedBatch) -> tuple[RowsFor, RowsFor]:
    """The decode kernel's rows (all their positions through ``kv_indices``) and the extend kernel's (all but the
    last position, which is the extend chunk)."""
    decode, extend = RowsFor([], [], []), RowsFor([], [], [])
    for row, (start, length) in enumerate(zip(batch.starts, batch.lengths)):
        part, read = (extend, length - 1 - start) if uses_extend(length) else (decode, length - start)
        part.rows.append(row)
        part.kv_starts.append(start)
        part.kv_lens.append(read)
    return decode, extend


class _SGLang(NamedTuple):
    """SGLang's three Triton entry points this kernel calls."""

    decode_attention_fwd: Callable[..., None]
    extend_attention_fwd: Callable[..., None]
    create_flashinfer_kv_indices_triton: Any  # a @triton.jit kernel, launched as kernel[grid](...)


KV_INDICES_PACKAGES = {"0.5.22": "sglang.kernels.ops.kvcache", "0.5.23": "sglang.kernels.ops.attention"}
"""Where each tested SGLang release keeps ``kv_indices`` (0.5.23 moved it beside the attention kernels); an untested
release is looked for where the newest tested one not newer than it keeps it."""


def _kv_indices_package() -> str:
    try:
        installed = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        installed = ""
    if installed in KV_INDICES_PACKAGES:
        return KV_INDICES_PACKAGES[installed]
    key = _release_key(installed)
    older = [package for version, package in KV_INDICES_PACKAGES.items() if _release_key(version) <= key]
    return older[-1] if older else next(iter(KV_INDICES_PACKAGES.values()))


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in version.split("+")[0].split("."))


def _load_sglang() -> _SGLang:
    def entry(package: str, module: str, name: str) -> Any:
        needs, install = (
            f"SGLang ({' or '.join(KV_INDICES_PACKAGES)}) and Triton",
            "`scripts/third_party_env.sh sglang@VERSION DIR` builds an environment with both",
        )
        return getattr(import_engine_module(NAME, f"{package}.{module}", needs, install), name)

    return _SGLang(
        entry("sglang.kernels.ops.attention", "decode_attention", "decode_attention_fwd"),
        entry("sglang.kernels.ops.attention", "extend_attention", "extend_attention_fwd"),
        entry(_kv_indices_package(), "kv_indices", "create_flashinfer_kv_indices_triton"),
    )


class SGLangTritonKernel:
    """SGLang's Triton decode and extend attention over kvfuzz's pools; held to
    :data:`~kvfuzz.kernels.base.DIFFERENT_KERNEL_TOLERANCE` (benchmarks/sglang_triton_tolerance.py measured at most
    1.8e-7 for float32 and 3.5e-4 for float16, docs/kernels.md)."""

    name = NAME

    def __init__(self, shape: ModelShape) -> None:
        interpret_on_cpu(NAME, shape)  # also refuses dtypes the interpreter cannot run
        self.sglang = _load_sglang()  # SGLang's kernels, imported after the interpreter was chosen

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        return different_kernel_tolerance(dtype)

    def kv_indices(self, table: torch.Tensor, part: RowsFor) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_indptr`` and ``kv_indices`` of ``part``'s rows, gathered out of ``table`` (``req_to_token``) by
        SGLang's own index kernel."""
        offsets = indptr(part.kv_lens).to(table.device)
        indices = torch.empty(max(int(offsets[-1]), 1), dtype=torch.int64, device=table.device)
        rows = torch.tensor(part.rows, dtype=torch.int64, device=table.device)
        self.sglang.create_flashinfer_kv_indices_triton[(len(part.rows),)](
            table,
            rows,
            torch.tensor(part.kv_lens, dtype=torch.int32, device=table.device),
            offsets,
            torch.tensor(part.kv_starts, dtype=torch.int32, device=table.device),
            indices,
            table.stride(0),
        )
        return offsets, indices

    def attend(self, batch: PagedBatch) -> torch.Tensor:
        table = req_to_token(batch).to(batch.queries.device)
        out = torch.empty_like(batch.queries)
        scale = batch.queries.shape[-1] ** -0.5  # the reference's
        decode, extend = split(batch)
        # The interpreter computes in NumPy: a split the decode kernel leaves empty subtracts -inf from -inf, which
        # SGLang's reduction then weighs by zero; NumPy's warning about it is noise.
        with numpy.errstate(invalid="ignore"):
            self._decode(batch, table, decode, out, scale)
            self._extend(batch, table, extend, out, scale)
        return out

    def _decode(self, batch: PagedBatch, table: torch.Tensor, decode: RowsFor, out: torch.Tensor, scale: float) -> None:
        """SGLang's decode kernel for ``decode``'s rows, layer by layer, into ``out``."""
        queries, keys, values = batch.queries, batch.keys, batch.values
        _, layers, query_heads, dim = queries.shape
        device = queries.device
        if not decode.rows:
            return
        decode_indptr, decode_indices = self.kv_indices(table, decode)
        count = len(decode.rows)
        logits = torch.empty((count, query_heads, MAX_KV_SPLITS, dim), dtype=torch.float32, device=device)
        lse = torch.empty((count, query_heads, MAX_KV_SPLITS), dtype=torch.float32, device=device)
        splits = torch.full((count,), MAX_KV_SPLITS, dtype=torch.int32, device=device)
        picked = torch.tensor(decode.rows, device=device)
        for layer in range(layers):
            o = torch.empty((count, query_heads, dim), dtype=queries.dtype, device=device)
            self.sglang.decode_attention_fwd(
                queries[picked, layer].contiguous(),
                keys[:, layer],
                values[:, layer],
                o,
                decode_indptr,
                decode_indices,
                logits,
                lse,
                splits,
                MAX_KV_SPLITS,
                scale,
                1.0,  # k_scale: the pools hold K unscaled
                1.0,  # v_scale
            )
            out[picked, layer] = o

    def _extend(self, batch: PagedBatch, table: torch.Tensor, extend: RowsFor, out: torch.Tensor, scale: float) -> None:
        """SGLang's extend kernel for ``extend``'s rows (a one-token chunk after a cached prefix), into ``out``."""
        queries, keys, values = batch.queries, batch.keys, batch.values
        _, layers, query_heads, dim = queries.shape
        device = queries.device
        if not extend.rows:
            return
        extend_indptr, extend_indices = self.kv_indices(table, extend)
        count = len(extend.rows)
        picked = torch.tensor(extend.rows, device=device)
        last = table[picked, torch.tensor([batch.lengths[row] - 1 for row in extend.rows], device=device)]
        chunk_indptr = indptr([1] * count).to(device)
        for layer in range(layers):
            o = torch.empty((count, query_heads, dim), dtype=queries.dtype, device=device)
            self.sglang.extend_attention_fwd(
                queries[picked, layer].contiguous(),
                keys[last, layer].contiguous(),  # the extend chunk's K/V: its token's, read at its slot
                values[last, layer].contiguous(),
                o,
                keys[:, layer],
                values[:, layer],
                chunk_indptr,
                extend_indptr,
                extend_indices,
                None,  # custom_mask
                True,  # is_causal
                None,  # mask_indptr
                1,  # max_len_extend
                1.0,  # k_scale
                1.0,  # v_scale
                sm_scale=scale,
            )
            out[picked, layer] = o
