"""vLLM's Triton unified attention (``vllm.v1.attention.ops.triton_unified_attention.unified_attention``, from the
installed vLLM package) as invariant 2's paged side: the kernel vLLM's Triton attention backend runs, reading
kvfuzz's pools in place through block tables built as that backend builds them (:mod:`kvfuzz.kernels.vllm_metadata`).

Every layer is one launch per group of rows sharing a block size and a sliding window; the pools
``[num_blocks * rows, L, Hkv, D]`` are viewed (never copied) as vLLM's ``[num_blocks, block_size, Hkv, D]`` cache of
one layer, the first ``tokens_per_block`` rows of each block. The softmax scale is ``head_dim ** -0.5``, the
reference's; query heads map to KV heads as in the reference (``num_queries_per_kv`` consecutive query heads each).

On CPU the kernel runs under Triton's interpreter, chosen by ``TRITON_INTERPRET=1``, which Triton reads when it is
first imported: :func:`prepare` sets it, before anything imports Triton. vLLM's ``triton_utils`` replaces Triton
with a placeholder when Triton reports no active GPU driver, unless ``CUDA_VISIBLE_DEVICES`` is set and empty (it
then takes the process for a distributed worker whose driver comes later); kvfuzz sets it
so only while :func:`prepare` imports ``vllm.triton_utils`` on CPU, before the allocator (and so vLLM) is
loaded, and restores it at once (docs/kernels.md says why this way).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from typing import Any, Callable, Iterator

import torch

from kvfuzz.kernels.base import KernelUnavailable, PagedBatch, Tolerance, different_kernel_tolerance
from kvfuzz.kernels.triton_setup import import_engine_module, interpret_on_cpu, on_cpu
from kvfuzz.kernels.vllm_metadata import Launch, launches
from kvfuzz.reference.content import ModelShape

OP_MODULE = "vllm.v1.attention.ops.triton_unified_attention"  # where vLLM 0.33.0 keeps unified_attention
INSTALL = "scripts/third_party_env.sh vllm builds an environment with both"


def _require(package: str, why: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise KernelUnavailable(f"kernel 'vllm-triton' needs {why}, which is not installed ({INSTALL})")


@contextlib.contextmanager
def _no_visible_devices() -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES`` set and empty for the block, then restored as it was."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def prepare(shape: ModelShape) -> None:
    """Set the process up for the kernel over pools of ``shape``, before Triton or vLLM is imported: on CPU, choose
    Triton's interpreter (refusing if Triton was already imported without it), refuse dtypes it cannot run, and
    import vLLM's ``triton_utils`` with no visible CUDA device, so that it keeps Triton (module docstring)."""
    _require("vllm", "vLLM 0.33.0 (its Triton unified attention)")
    _require("triton", "Triton (pip install 'kvfuzz[triton]')")
    if not on_cpu(shape):
        return
    interpret_on_cpu("vllm-triton", shape)
    if "vllm.triton_utils" not in sys.modules:  # it decides once, on import, whether Triton is usable
        with _no_visible_devices():
            _import("vllm.triton_utils")


def _import(module: str) -> Any:
    return import_engine_module("vllm-triton", module, "vLLM 0.33.0 and Triton", INSTALL)


def load_unified_attention(shape: ModelShape) -> Callable[..., None]:
    """vLLM's ``unified_attention`` with Triton behind it (never vLLM's placeholder); :func:`prepare` first."""
    prepare(shape)
    if not _import("vllm.triton_utils").HAS_TRITON:
        raise KernelUnavailable(
            "kernel 'vllm-triton': vLLM disabled Triton here: it saw no GPU driver (was vLLM imported before "
            "kvfuzz prepared the kernel?)"
        )
    function: Callable[..., None] = _import(OP_MODULE).unified_attention
    return function


class VllmTritonKernel:
    """vLLM's Triton unified attention over the paged pools; held to
    :data:`~kvfuzz.kernels.base.DIFFERENT_KERNEL_TOLERANCE` (measured: docs/kernels.md).

    ``split_kv`` chooses vLLM's split-KV ("3D") decode path, which its backend takes for decode batches of up to
    ``128 / Hkv`` sequences; without it (the default: about a third of the interpreter's cost) the single-pass
    ("2D") path runs, which vLLM takes for prefill and for larger batches."""

    name = "vllm-triton"

    def __init__(self, shape: ModelShape, split_kv: bool = False) -> None:
        self.unified_attention = load_unified_attention(shape)  # vLLM's function
        self.split_kv = split_kv  # vLLM's split-KV decode path instead of its single-pass one

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        return different_kernel_tolerance(dtype)

    def _split_kv_buffers(self, rows: int, kv_heads: int, query_heads: int, dim: int, device: torch.device) -> dict:
        """The scratch vLLM's backend allocates for its split-KV path, and its threshold (batches above it take
        the single-pass path, as in vLLM)."""
        from vllm.v1.attention.backends.triton_attn import MIN_LAUNCH_GRID_SIZE_2D, NUM_PAR_SOFTMAX_SEGMENTS

        segments, padded = NUM_PAR_SOFTMAX_SEGMENTS, 1 << (dim - 1).bit_length()
        return {
            "seq_threshold_3D": MIN_LAUNCH_GRID_SIZE_2D // kv_heads,
            "num_par_softmax_segments": segments,
            "softmax_segm_output": torch.empty(rows, query_heads, segments, padded, device=device),
            "softmax_segm_max": torch.empty(rows, query_heads, segments, device=device),
            "softmax_segm_expsum": torch.empty(rows, query_heads, segments, device=device),
        }

    def _launch(self, batch: PagedBatch, launch: Launch, layer: int, out: torch.Tensor) -> None:
        slots, layers, kv_heads, dim = batch.keys.shape
        cache_shape = (batch.num_blocks, batch.block_size, layers, kv_heads, dim)
        size = launch.tokens_per_block
        keys = batch.keys.view(cache_shape)[:, :size, layer]  # [num_blocks, size, Hkv, D], a view
        values = batch.values.view(cache_shape)[:, :size, layer]
        rows = list(launch.rows)
        queries = batch.queries[rows, layer]  # [R, Hq, D]: one query token per row
        result = torch.empty_like(queries)
        device = batch.keys.device
        extra = self._split_kv_buffers(len(rows), kv_heads, queries.shape[1], dim, device) if self.split_kv else {}
        self.unified_attention(
            q=queries,
            k=keys,
            v=values,
            out=result,
            cu_seqlens_q=launch.cu_seqlens_q.to(device),
            max_seqlen_q=1,
            seqused_k=launch.seqused_k.to(device),
            max_seqlen_k=launch.max_seqlen_k,
            softmax_scale=dim**-0.5,
            causal=True,
            window_size=launch.window_size,
            block_table=launch.block_table.to(device),
            softcap=0,
            q_descale=None,
            k_descale=None,
            v_descale=None,
            **extra,
        )
        out[rows, layer] = result

    def attend(self, batch: PagedBatch) -> torch.Tensor:
        out = torch.empty_like(batch.queries)
        plan = launches(batch)
        for layer in range(batch.queries.shape[1]):
            for launch in plan:
                self._launch(batch, launch, layer, out)
        return out
