"""llama.cpp through llama-cpp-python's low-level ctypes API: one context over the tiny model, and what can be
read back of its KV cache.

llama.cpp's public API does not expose cell indices: ``llama_memory_*`` answers per sequence (``seq_pos_min``,
``seq_pos_max``) and the state API serialises cells without their indices. Three things are read back here, each
through a public interface:

* the cells a ``llama_decode`` writes: the graph's ``ggml_set_rows`` into ``cache_k_l{layer}`` takes the index
  tensor the KV cache filled from its own slot search (``k_idxs``); the context's eval callback (``cb_eval``, a
  ``llama_context_params`` field) sees that node after it ran, and reads the indices from host memory;
* the cells each new token attends to: the attention mask input ``attn_inp_kq_mask`` (0 where a cell is visible,
  -inf where masked), one row per token, one column per cell, read in the same callback;
* every used cell's position and sequence ids, in cell-index order: ``llama_state_seq_get_data`` with sequence -1
  writes the cache's metadata (position, then the sequence ids) for each non-empty cell, in index order.

The callback reads ``struct ggml_tensor`` through a ctypes mirror of its layout in the ggml.h that llama-cpp-python
0.3.36 vendors (the version the recipe pins); it checks what it reads (the index tensor is ``GGML_TYPE_I64``, the
mask f32, one entry or row per token) and fails loudly otherwise.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import re
import struct
import tempfile
from pathlib import Path
from typing import Any, Optional

import attrs

if importlib.util.find_spec("llama_cpp") is None:
    raise ImportError(
        "kvfuzz.adapters.llama_cpp needs llama-cpp-python; build an environment with "
        "scripts/third_party_env.sh llama-cpp"
    )

GGML_MAX_DIMS = 4  # ggml.h
GGML_MAX_SRC = 10  # ggml.h
GGML_MAX_OP_PARAMS = 64  # ggml.h, in bytes
GGML_MAX_NAME = 64  # ggml.h
GGML_TYPE_F32 = 0  # enum ggml_type
GGML_TYPE_I64 = 27  # enum ggml_type
LLAMA_FLASH_ATTN_TYPE_DISABLED = 0  # the mask then reaches soft_max as f32, as the adapter reads it
STATE_MAGIC = 0xAF143CD8  # llama_context's io_magic, the first word of a sequence's state
_K_CACHE = re.compile(r"cache_k_l(\d+)\b")  # the name of a layer's K cache, and of the views written into it
CELLS_PADDING = 256  # llama_context pads n_ctx (and so the unified cache) to a multiple of this


class _GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor`` as ggml.h lays it out (only the fields read here are used)."""


_GgmlTensor._fields_ = [
    ("type", ctypes.c_int),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
    ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
    ("op", ctypes.c_int),
    ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
    ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(_GgmlTensor) * GGML_MAX_SRC),
    ("view_src", ctypes.POINTER(_GgmlTensor)),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * GGML_MAX_NAME),
    ("extra", ctypes.c_void_p),
    ("padding", ctypes.c_char * 8),
]


_silent_log: Any = None  # the ctypes log callback, kept alive for the process


def _log(level: int, text: bytes, user_data: Any) -> None:
    """llama.cpp's log goes nowhere: kvfuzz reports what matters itself."""


@functools.lru_cache(maxsize=None)
def _llama() -> Any:
    """The llama_cpp module, loaded once, with llama.cpp's log silenced and its backend initialised."""
    import llama_cpp

    global _silent_log
    _silent_log = llama_cpp.llama_log_callback(_log)
    llama_cpp.llama_log_set(_silent_log, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    return llama_cpp


@functools.lru_cache(maxsize=None)
def _op_name() -> Any:
    """ggml's ``ggml_op_name(enum ggml_op)``, from the libggml llama-cpp-python ships."""
    from llama_cpp._ggml import libggml

    function = libggml.ggml_op_name
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_char_p
    return function


@functools.lru_cache(maxsize=None)
def tiny_model() -> Any:
    """The tiny llama model (kvfuzz.adapters.llama_cpp.model), written to a temporary directory and loaded once per
    process; every context shares its weights. The file is removed once loaded (a mapping of it outlives its
    name)."""
    from kvfuzz.adapters.llama_cpp.model import write_tiny_llama

    llama = _llama()
    params = llama.llama_model_default_params()
    params.n_gpu_layers = 0
    with tempfile.TemporaryDirectory(prefix="kvfuzz-llama-") as directory:
        path = write_tiny_llama(Path(directory) / "tiny-llama.gguf")
        model = llama.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise RuntimeError("llama.cpp could not load the tiny model kvfuzz wrote")
    return model


@attrs.frozen
class Decoded:
    """What one ``llama_decode`` of one sequence's tokens did, as read back from the graph it ran."""

    status: int  # llama_decode's return: 0 done, 1 no KV slot for the batch (nothing changed), other: an error
    written: tuple[int, ...]  # the cell each token's K/V went to, in token order (empty unless status is 0)
    visible: tuple[frozenset[int], ...]  # per token, the cells its attention mask lets it read
    logits: tuple[float, ...]  # the last token's logits


@attrs.frozen
class UsedCell:
    """One non-empty cell of the cache, as the state API serialises it."""

    pos: int  # the position it holds
    seq_ids: frozenset[int]  # the sequences holding it


class Context:
    """One llama.cpp context over the tiny model, with a unified KV cache of ``num_cells`` cells (one stream: every
    sequence's cells in one buffer, so ``seq_cp`` shares cells instead of copying buffers) and flash attention off.

    ``ubatch`` is llama.cpp's n_ubatch: a decode of more tokens is split into micro-batches of that many, placed
    together before any is computed (``llama_kv_cache::prepare``), then computed one by one, each in its own graph.

    Invariant kept: ``_ubatches`` holds what the eval callback read during the latest ``decode`` only, one entry per
    micro-batch computed, in order.
    """

    def __init__(self, num_cells: int, num_seqs: int, ubatch: Optional[int] = None) -> None:
        if num_cells % CELLS_PADDING:
            raise ValueError(
                f"llama.cpp pads its context to a multiple of {CELLS_PADDING} cells; asked for {num_cells}"
            )
        llama = _llama()
        model = tiny_model()
        self._llama = llama  # the llama_cpp module
        self._ubatches: list[_Ubatch] = []  # what the latest decode's micro-batches wrote and read
        self._callback = llama.ggml_backend_sched_eval_callback(self._observe)  # kept alive with the context
        params = llama.llama_context_default_params()
        params.n_ctx = num_cells
        params.n_batch = num_cells
        params.n_ubatch = ubatch or num_cells
        params.n_seq_max = num_seqs
        params.n_threads = 1
        params.n_threads_batch = 1
        params.kv_unified = True
        params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.cb_eval = self._callback
        params.cb_eval_user_data = None
        context = llama.llama_init_from_model(model, params)
        if not context:
            raise RuntimeError(f"llama.cpp could not make a context of {num_cells} cells")
        self._context = context  # the llama_context pointer
        self._memory = llama.llama_get_memory(context)  # its KV cache (llama_memory_t)
        self.num_cells = int(llama.llama_n_ctx(context))  # the cells the cache has: n_ctx, unified
        self.vocabulary = int(llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model)))  # logits per token
        self._batch = llama.llama_batch_init(num_cells, 0, 1)  # one sequence id per token

    def close(self) -> None:
        if self._context:
            self._llama.llama_batch_free(self._batch)
            self._llama.llama_free(self._context)
            self._context = None

    def __del__(self) -> None:
        self.close()

    # -- the memory API ---------------------------------------------------------------------------------------

    def decode(self, seq_id: int, tokens: tuple[int, ...], start: int) -> Decoded:
        """``llama_decode`` of ``tokens`` for ``seq_id`` at positions ``start ..``, logits for the last token."""
        batch = self._batch
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = i == len(tokens) - 1
        batch.n_tokens = len(tokens)
        self._ubatches = []
        status = int(self._llama.llama_decode(self._context, batch))
        if status != 0:
            return Decoded(status, (), (), ())
        written: list[int] = []
        visible: list[frozenset[int]] = []
        for ubatch in self._ubatches:
            cells = ubatch.writes[0] if ubatch.writes else ()
            if any(layer != cells for layer in ubatch.writes) or ubatch.mask is None:
                raise RuntimeError(f"llama_decode's micro-batch was not read back whole: {ubatch}")
            written.extend(cells)
            visible.extend(ubatch.mask[: len(cells)])
        if len(written) != len(tokens):
            raise RuntimeError(f"llama_decode of {len(tokens)} tokens: read writes to {written}")
        row = self._llama.llama_get_logits_ith(self._context, -1)
        logits = tuple(float(row[i]) for i in range(self.vocabulary))
        return Decoded(status, tuple(written), tuple(visible), logits)

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        return bool(self._llama.llama_memory_seq_rm(self._memory, seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self._llama.llama_memory_seq_cp(self._memory, src, dst, p0, p1)

    def clear(self) -> None:
        self._llama.llama_memory_clear(self._memory, True)

    def pos_min(self, seq_id: int) -> int:
        return int(self._llama.llama_memory_seq_pos_min(self._memory, seq_id))

    def pos_max(self, seq_id: int) -> int:
        return int(self._llama.llama_memory_seq_pos_max(self._memory, seq_id))

    def used_cells(self, seq_id: int = -1) -> tuple[UsedCell, ...]:
        """The non-empty cells (of ``seq_id``, or all with -1), in cell-index order, from the state API: the magic
        word, the sequence id, the number of streams, then per stream the cell count and each cell's position,
        count of sequence ids and ids (the K/V rows that follow are not read)."""
        llama = self._llama
        size = int(llama.llama_state_seq_get_size(self._context, seq_id))
        buffer = (ctypes.c_uint8 * size)()
        written = int(llama.llama_state_seq_get_data(self._context, buffer, size, seq_id))
        data = bytes(buffer)[:written]
        magic, written_seq, num_streams = struct.unpack_from("<Iii", data, 0)
        if magic != STATE_MAGIC or written_seq != seq_id or num_streams != 1:
            raise RuntimeError(
                f"llama.cpp's sequence state starts {magic:#x}, seq {written_seq}, {num_streams} streams; "
                f"expected {STATE_MAGIC:#x}, seq {seq_id}, one stream (the cache is unified)"
            )
        (count,) = struct.unpack_from("<I", data, 12)
        offset, cells = 16, []
        for _ in range(count):
            pos, num_ids = struct.unpack_from("<iI", data, offset)
            ids = struct.unpack_from(f"<{num_ids}i", data, offset + 8)
            offset += 8 + 4 * num_ids
            cells.append(UsedCell(pos, frozenset(ids)))
        return tuple(cells)

    # -- the eval callback ------------------------------------------------------------------------------------

    def _observe(self, pointer: Optional[int], ask: bool, user_data: Any) -> bool:
        """Asked about each graph node before it runs (``ask``): wants the K writes and the first softmax; called
        again once such a node ran, and reads its index tensor or its mask."""
        if not pointer:
            return True
        node = _GgmlTensor.from_address(pointer)
        op = _op_name()(node.op)
        name = node.name.decode(errors="replace")
        layer = _K_CACHE.match(name)
        if op == b"SET_ROWS" and layer:
            if not ask:
                if layer.group(1) == "0":  # the first layer: a new micro-batch's graph
                    self._ubatches.append(_Ubatch())
                self._ubatches[-1].writes.append(_read_indices(node.src[1].contents))
            return True
        if op == b"SOFT_MAX" and node.src[1] and self._ubatches and self._ubatches[-1].mask is None:
            if not ask:
                self._ubatches[-1].mask = _read_mask(node.src[1].contents)
            return True
        return False


@attrs.define
class _Ubatch:
    """What the eval callback read of one micro-batch's graph."""

    writes: list[tuple[int, ...]] = attrs.field(factory=list)  # per layer, the cells its K write went to
    mask: Optional[tuple[frozenset[int], ...]] = None  # the first layer's attention mask, one row per token


def _read_indices(tensor: _GgmlTensor) -> tuple[int, ...]:
    if tensor.type != GGML_TYPE_I64 or not tensor.data:
        raise RuntimeError(f"the K write's index tensor {tensor.name!r} is not a host I64 tensor")
    count = int(tensor.ne[0])
    return tuple(int(i) for i in (ctypes.c_int64 * count).from_address(tensor.data))


def _read_mask(tensor: _GgmlTensor) -> tuple[frozenset[int], ...]:
    if tensor.type != GGML_TYPE_F32 or not tensor.data:
        raise RuntimeError(f"the attention mask {tensor.name!r} is not a host f32 tensor")
    num_cells, num_rows, stride = int(tensor.ne[0]), int(tensor.ne[1]), int(tensor.nb[1])
    rows = []
    for row in range(num_rows):
        values = (ctypes.c_float * num_cells).from_address(tensor.data + row * stride)
        rows.append(frozenset(cell for cell in range(num_cells) if values[cell] == 0.0))
    return tuple(rows)
