"""FlashInfer's paged attention as invariant 2's kernel: ``flashinfer`` (``BatchDecodeWithPagedKVCacheWrapper``) and
``flashinfer-prefill`` (``BatchPrefillWithPagedKVCacheWrapper``, one causal query per row), CUDA only.

Both read kvfuzz's pools in place, per layer, in FlashInfer's ``NHD`` layout: the pools ``[num_blocks * block_size,
L, Hkv, D]`` are viewed (never copied) as ``[num_blocks, page_size, Hkv, D]`` for layer ``l``, a strided view whose
page stride is the pool's block stride and whose ``page_size`` is the tokens a block holds in the row's table (fewer
than the pool's rows for a KV-cache group of smaller blocks). The page tables come from
:func:`kvfuzz.kernels.page_tables.page_tables` (one plan per page size and sliding window); a plan is made once and
run for every layer. FlashInfer maps query head ``j`` to KV head ``j // (Hq / Hkv)`` (GQA), the reference's grouping,
and scales by ``1 / sqrt(D)``, the reference's scale.

The ``flashinfer`` package is imported only when a kernel is made, so importing :mod:`kvfuzz.kernels` never loads it.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from kvfuzz.kernels.base import KernelUnavailable, PagedBatch, Tolerance, different_kernel_tolerance
from kvfuzz.kernels.page_tables import PageTables, page_tables
from kvfuzz.reference.content import ModelShape

WORKSPACE_BYTES = 128 * 1024 * 1024
"""FlashInfer's float workspace, the size its documentation's examples allocate."""

HEAD_DIMS = (64, 128, 256)
"""Head dimensions FlashInfer's prebuilt and JIT kernels are documented for."""

DTYPES = (torch.float16, torch.bfloat16)
"""Pool dtypes FlashInfer's paged kernels take for queries and K/V alike."""


def check_flashinfer(name: str, shape: ModelShape) -> Any:
    """The imported ``flashinfer`` module, after checking that kernel ``name`` can run over pools of ``shape`` here;
    raises :class:`KernelUnavailable` with one line naming what is missing."""
    if torch.device(shape.device).type != "cuda":
        raise KernelUnavailable(f"--kernel {name} runs on CUDA only (FlashInfer has no CPU kernels): use --device cuda")
    if shape.dtype not in DTYPES:
        raise KernelUnavailable(f"--kernel {name} needs --dtype float16 or bfloat16, not {shape.dtype}")
    if shape.head_dim not in HEAD_DIMS:
        raise KernelUnavailable(
            f"--kernel {name} needs --head-dim {', '.join(map(str, HEAD_DIMS))}, not {shape.head_dim}"
        )
    try:
        return importlib.import_module("flashinfer")
    except ImportError as error:
        raise KernelUnavailable(
            f"--kernel {name} needs the flashinfer package (pip install flashinfer-python): {_one_line(error)}"
        ) from None
    except Exception as error:  # noqa: BLE001 -- a package that fails to load (a CUDA mismatch): why, in one line
        raise KernelUnavailable(
            f"--kernel {name}: importing flashinfer raised {type(error).__name__}: {_one_line(error)}"
        ) from None


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def layer_pages(pool: torch.Tensor, layer: int, block_size: int, page_size: int) -> torch.Tensor:
    """Layer ``layer`` of ``pool`` ``[num_blocks * block_size, L, H, D]`` as ``[num_blocks, page_size, H, D]`` pages
    (FlashInfer's ``NHD``): a view whose page ``b`` is the first ``page_size`` rows of physical block ``b``."""
    rows, _layers, heads, dim = pool.shape
    row_stride, layer_stride, head_stride, dim_stride = pool.stride()
    return pool.as_strided(
        (rows // block_size, page_size, heads, dim),
        (block_size * row_stride, row_stride, head_stride, dim_stride),
        pool.storage_offset() + layer * layer_stride,
    )


def _int32(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


class FlashInferKernel:
    """FlashInfer's paged decode (``prefill=False``) or prefill wrapper; held to
    :data:`~kvfuzz.kernels.base.DIFFERENT_KERNEL_TOLERANCE`, provisionally (docs/kernels.md)."""

    def __init__(self, shape: ModelShape, prefill: bool) -> None:
        self.name = "flashinfer-prefill" if prefill else "flashinfer"
        flashinfer = check_flashinfer(self.name, shape)
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=shape.device)  # zeroed, as its docs ask
        self._prefill = prefill  # one causal query per row through the prefill wrapper, else the decode wrapper
        if prefill:
            self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        else:
            self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        return different_kernel_tolerance(dtype)

    def _plan(self, tables: PageTables, batch: PagedBatch) -> None:
        device, dtype = batch.keys.device, batch.keys.dtype
        _rows, _layers, query_heads, dim = batch.queries.shape
        kv_heads = batch.keys.shape[2]
        common = (
            _int32(tables.kv_indptr, device),
            _int32(tables.kv_indices, device),
            _int32(tables.kv_last_page_len, device),
            query_heads,
            kv_heads,
            dim,
            tables.page_size,
        )
        if self._prefill:
            qo_indptr = torch.arange(len(tables.rows) + 1, dtype=torch.int32, device=device)
            self._wrapper.plan(
                qo_indptr, *common, causal=True, window_left=tables.window_left, q_data_type=dtype, kv_data_type=dtype
            )
        else:
            self._wrapper.plan(
                *common, pos_encoding_mode="NONE", window_left=tables.window_left, q_data_type=dtype, kv_data_type=dtype
            )

    def attend(self, batch: PagedBatch) -> torch.Tensor:
        out = torch.empty_like(batch.queries)
        layers = batch.queries.shape[1]
        for tables in page_tables(batch):
            self._plan(tables, batch)
            rows = torch.tensor(tables.rows, device=batch.queries.device)
            for layer in range(layers):
                pages = (
                    layer_pages(batch.keys, layer, batch.block_size, tables.page_size),
                    layer_pages(batch.values, layer, batch.block_size, tables.page_size),
                )
                out[rows, layer] = self._wrapper.run(batch.queries[rows, layer].contiguous(), pages)
        return out
