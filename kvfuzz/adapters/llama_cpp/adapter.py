"""llama.cpp's unified KV cache (``llama_kv_cache``, llama-cpp-python 0.3.36) behind kvfuzz's contract.

The adapter is a scheduler shim in the manner of llama.cpp's own server: each kvfuzz sequence is a llama.cpp
``seq_id`` in one context whose cache is unified (one buffer of cells shared by every sequence), and each operation
is the memory call the server makes for it (it clears a slot with ``seq_rm(id, -1, -1)``, copies a slot into another
with ``seq_cp(id, other, -1, -1)``, and drops rejected drafts with ``seq_rm`` of the tail):

* ``admit``: ``llama_decode`` of the prompt, every token tagged with the sequence's ``seq_id``, at positions
  ``0 .. len - 1``; a preempted sequence comes back the same way, with every token it had;
* ``grow``: ``llama_decode`` of the new tokens at the next positions;
* ``fork``: ``llama_memory_seq_cp(parent, child, -1, -1)``: the child joins every cell of the parent (no copy);
* ``free`` and ``preempt``: ``llama_memory_seq_rm(seq, -1, -1)``;
* ``rollback``: ``llama_memory_seq_rm(seq, len - n, -1)``: the tail positions go.

llama.cpp decodes at once, so K/V are in the cache when ``admit`` or ``grow`` returns and ``step_completed`` has
nothing to do. A ``llama_decode`` that finds no room returns 1 and leaves the cache as it was: ``OutOfBlocks``.

**The mapping of blocks.** A llama.cpp cell holds one token's K/V and the cache places each token in any empty
cell (``find_slot`` tests them one by one), so the honest block is one cell: ``block_size`` = 1. A sequence's block
table is its cells in position order; a cell shared after ``seq_cp`` is a block with several references. llama.cpp
pads a context to a multiple of 256 cells, so a pool of ``num_blocks`` is a cache of the next multiple of 256 whose
first cells (as many as the padding) hold a ballast sequence: decoded first into the empty cache, it takes cells
``0 .. padding - 1``, kvfuzz never touches it, and llama.cpp must step over it like any sequence's cells. kvfuzz's
block ``b`` is then llama.cpp's cell ``b + padding``, and llama.cpp has exactly ``num_blocks`` cells to give.

**What is read back.** llama.cpp's API does not expose cell indices; the adapter reads them where the library
itself uses them (``_library``): the cells each decode writes (the K write's index tensor), and the cells each new
token attends to (its attention-mask row). Between decodes it follows the memory calls' documented effect on that
picture (``seq_cp`` adds the child to the parent's cells, ``seq_rm`` removes the sequence from the cells of the
range; a cell no sequence holds is empty), and after every call it checks the picture against what llama.cpp
says: every used cell's position and sequence ids in cell order (the state API), each live sequence's
``seq_pos_min`` and ``seq_pos_max``, the mask of the token just decoded (exactly its sequence's cells), and the
logits of that token against a fresh contiguous decode of the same tokens in a second context (the end-to-end check
that the cells it read hold the right K/V). A disagreement is raised as an ``AllocatorError`` naming the call,
the sequence and the cells: kvfuzz reports it (invariant 11), and the adapter never repairs it.

What cannot be observed: the cache's empty cells are seen only as the complement of the used ones, and the
positions of used cells only in index order, so a cell that moved while keeping its order would go unseen
between decodes (the next decode's mask would show it); K/V bytes are compared through the logits only.

Not supported: prefix caching and eviction (llama.cpp matches no prompt across sequences; the server's prompt
reuse is per slot), swap (llama.cpp's state save/restore numbers no host blocks), namespaces. The number of live
sequences is bounded by ``n_seq_max`` (256 at most): a sequence id llama.cpp cannot give is refused with
``OutOfBlocks``, a limit the contract has no word for (docs/real-allocators.md).
"""

from __future__ import annotations

import functools
from typing import Collection, Optional

import attrs

from kvfuzz.adapters.base import SequenceLedger
from kvfuzz.adapters.llama_cpp._library import CELLS_PADDING, Context, Decoded
from kvfuzz.allocator.errors import AllocatorError, InvalidArgument, OutOfBlocks, Unsupported
from kvfuzz.allocator.types import (
    AdmitResult,
    BlockCopy,
    Capabilities,
    GrowResult,
    Namespace,
    PoolSpec,
    SeqId,
    Slot,
    Tokens,
)

LOGITS_TOLERANCE = 1e-3
"""Largest difference allowed between a decode's logits and a fresh contiguous decode's: the two read the same K/V
in a different cell order, so float sums may differ in the last bits. ``benchmarks/llama_cpp_tolerance.py``
measures the margin: at most 7.6e-5 over 1295 clean decodes, at least 0.06 when one earlier token is wrong."""

MAX_SEQUENCES = 256
"""llama.cpp's LLAMA_MAX_SEQ: the most sequence ids a context may have. The last one is the ballast's."""

BALLAST_TOKEN = 0
"""The token the ballast sequence repeats."""


@attrs.define
class _Sequence:
    """A live (or preempted) kvfuzz sequence: its llama.cpp id and its tokens."""

    seq_id: int  # llama.cpp's seq_id while the sequence holds cells; -1 while preempted
    tokens: list[int]  # every token, in order (position i holds tokens[i])


@functools.lru_cache(maxsize=None)
def _reference(num_cells: int) -> Context:
    """The context the contiguous recomputations run in (one per process and size: each use clears it first)."""
    return Context(num_cells, 1)


class LlamaCppKVCache:
    """llama.cpp's unified KV cache, one cell per block, driven through llama-cpp-python.

    Invariant kept: ``_cells`` maps every cell llama.cpp holds for some sequence (the ballast included) to
    (position, llama seq ids), as the calls so far have made it and as llama.cpp's own answers confirmed after the
    latest call; a cell absent is empty. Every running sequence's cells hold positions ``0 .. len - 1`` exactly
    once; the ballast holds cells ``0 .. ballast - 1``.
    """

    block_size = 1
    num_host_blocks = 0

    def __init__(self, spec: PoolSpec, *, ubatch: Optional[int] = None) -> None:
        if spec.block_size != 1:
            raise ValueError(
                f"llama.cpp's KV cache holds one token per cell: block_size must be 1, not {spec.block_size}"
            )
        num_cells = -(-spec.num_blocks // CELLS_PADDING) * CELLS_PADDING
        self._context = Context(num_cells, MAX_SEQUENCES, ubatch)  # the cache under test
        self._reference = _reference(num_cells)  # a second context over the same weights
        self.num_blocks = spec.num_blocks
        # Swap is not driven for llama.cpp, and it keeps no cache of finished sequences (no eviction): no swap_out,
        # swap_in, evict or reset_cache.
        self.capabilities = Capabilities(fork=True, rollback=True, introspection=True)
        self._ledger = SequenceLedger()  # phases, and the misuse checks
        self._seqs: dict[SeqId, _Sequence] = {}  # every sequence held or preempted
        self._cells: dict[int, tuple[int, frozenset[int]]] = {}  # used cell -> (position, llama seq ids)
        self._ballast = num_cells - spec.num_blocks  # cells 0 .. ballast - 1 are the ballast's
        self._ballast_id = MAX_SEQUENCES - 1  # the ballast's llama seq id, never given to a kvfuzz sequence
        if self._ballast:
            tokens = (BALLAST_TOKEN,) * self._ballast
            decoded = self._context.decode(self._ballast_id, tokens, 0)
            if decoded.status != 0 or decoded.written != tuple(range(self._ballast)):
                raise RuntimeError(
                    f"the ballast of {self._ballast} tokens went to cells {decoded.written} (status {decoded.status}), "
                    f"not to cells 0 .. {self._ballast - 1} of the empty cache"
                )
            for pos, cell in enumerate(decoded.written):
                self._cells[cell] = (pos, frozenset({self._ballast_id}))
            self._verify(f"the ballast's decode ({self._ballast} cells)")

    # -- operations -------------------------------------------------------------------------------------------

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> AdmitResult:
        readmitted = self._ledger.check_admit(seq, tokens)
        if namespace != ():
            raise Unsupported(f"admit: llama.cpp has no namespaces; {seq!r} came with {namespace!r}")
        tokens = tuple(tokens)
        if readmitted and self._seqs[seq].tokens != list(tokens):
            raise InvalidArgument(f"admit: preempted sequence {seq!r} must come back with the tokens it had")
        seq_id = self._free_seq_id(seq)
        decoded = self._decode("admit", seq, seq_id, tokens, 0)
        self._seqs[seq] = _Sequence(seq_id, list(tokens))
        self._ledger.admitted(seq)
        self._written("admit", seq, seq_id, decoded, 0)
        return AdmitResult(self.block_table(seq), 0)

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        self._ledger.running(seq, "grow")
        self._ledger.check_tokens("grow", seq, tokens)
        state = self._seqs[seq]
        start = len(state.tokens)
        decoded = self._decode("grow", seq, state.seq_id, tuple(tokens), start)
        state.tokens.extend(tokens)
        self._written("grow", seq, state.seq_id, decoded, start)
        return GrowResult(tuple(Slot(cell - self._ballast, 0) for cell in decoded.written))

    def fork(self, parent: SeqId, child: SeqId) -> Optional[list[BlockCopy]]:
        self._ledger.check_fork(parent, child)
        source = self._seqs[parent]
        seq_id = self._free_seq_id(child)
        self._context.seq_cp(source.seq_id, seq_id, -1, -1)
        for cell, (pos, ids) in list(self._cells.items()):
            if source.seq_id in ids:
                self._cells[cell] = (pos, ids | {seq_id})
        self._seqs[child] = _Sequence(seq_id, list(source.tokens))
        self._ledger.admitted(child)
        self._verify(f"fork({parent!r}, {child!r}) (seq_cp {source.seq_id} -> {seq_id})")
        return None

    def free(self, seq: SeqId) -> None:
        self._ledger.live(seq, "free")
        self._remove(seq, "free")
        del self._seqs[seq]
        self._ledger.freed(seq)

    def preempt(self, seq: SeqId) -> None:
        self._ledger.running(seq, "preempt")
        self._remove(seq, "preempt")
        self._ledger.preempted(seq)

    def rollback(self, seq: SeqId, num_tokens: int) -> None:
        self._ledger.running(seq, "rollback")
        state = self._seqs[seq]
        if not 1 <= num_tokens < len(state.tokens):
            raise InvalidArgument(f"rollback: {seq!r} holds {len(state.tokens)} tokens; cannot drop {num_tokens}")
        keep = len(state.tokens) - num_tokens
        if not self._context.seq_rm(state.seq_id, keep, -1):
            raise AllocatorError(f"rollback: llama_memory_seq_rm({state.seq_id}, {keep}, -1) returned false")
        self._drop(state.seq_id, keep)
        del state.tokens[keep:]
        self._verify(f"rollback({seq!r}, {num_tokens}) (seq_rm {state.seq_id} from position {keep})")

    def step_completed(self, step: int) -> None:
        """llama_decode computes K/V before it returns: a step has nothing left to do."""

    def block_table(self, seq: SeqId) -> tuple[int, ...]:
        self._ledger.live(seq, "block_table")
        return tuple(cell - self._ballast for cell in self._cells_of(self._seqs[seq].seq_id))

    # -- introspection ----------------------------------------------------------------------------------------

    def refcount(self, block: int) -> int:
        cell = self._cells.get(block + self._ballast)
        return 0 if cell is None else len(cell[1])

    def free_blocks(self) -> Collection[int]:
        return [block for block in range(self.num_blocks) if block + self._ballast not in self._cells]

    def cached_blocks(self) -> Collection[int]:
        return ()

    def pending_blocks(self) -> Collection[int]:
        return ()

    def library_block_name(self, block: int) -> str:
        return f"llama.cpp cell {block + self._ballast}"

    # -- helpers ----------------------------------------------------------------------------------------------

    def _cells_of(self, seq_id: int) -> list[int]:
        """The cells holding ``seq_id``, in position order."""
        return [cell for _, cell in sorted((pos, cell) for cell, (pos, ids) in self._cells.items() if seq_id in ids)]

    def _free_seq_id(self, seq: SeqId) -> int:
        used = {state.seq_id for state in self._seqs.values()}
        for seq_id in range(self._ballast_id):
            if seq_id not in used:
                return seq_id
        raise OutOfBlocks(f"{seq!r}: every one of llama.cpp's {self._ballast_id} sequence ids is in use")

    def _decode(self, op: str, seq: SeqId, seq_id: int, tokens: tuple[int, ...], start: int) -> Decoded:
        decoded = self._context.decode(seq_id, tokens, start)
        if decoded.status == 1:
            self._verify(f"{op}({seq!r}), refused by llama_decode")
            raise OutOfBlocks(
                f"{op}: llama_decode found no cells for {len(tokens)} tokens of {seq!r}",
                needed=len(tokens),
                available=len(self.free_blocks()),
            )
        if decoded.status != 0:
            raise AllocatorError(f"{op}: llama_decode of {len(tokens)} tokens of {seq!r} returned {decoded.status}")
        return decoded

    def _written(self, op: str, seq: SeqId, seq_id: int, decoded: Decoded, start: int) -> None:
        """Record the cells a decode wrote (as llama.cpp's apply_ubatch does: a cell written is the new token's
        alone), then check the picture and the decode's attention against llama.cpp."""
        call = f"{op}({seq!r}) (seq {seq_id}, positions {start}..{start + len(decoded.written) - 1})"
        ballast = [cell for cell in decoded.written if cell < self._ballast]
        if ballast:
            raise AllocatorError(f"{call}: llama.cpp wrote into the ballast's cells {ballast}, which it holds")
        for offset, cell in enumerate(decoded.written):
            self._cells[cell] = (start + offset, frozenset({seq_id}))
        self._verify(call)
        cells = set(self._cells_of(seq_id))
        if decoded.visible[-1] != cells:
            raise AllocatorError(
                f"{call}: the last token's attention mask reads cells {sorted(decoded.visible[-1])}, "
                f"but the sequence's cells are {sorted(cells)}"
            )
        tokens = tuple(self._seqs[seq].tokens)
        difference = self._logits_difference(tokens, decoded.logits)
        if difference > LOGITS_TOLERANCE:
            raise AllocatorError(
                f"{call}: the logits differ by {difference:.3g} from a fresh contiguous decode of the same "
                f"{len(tokens)} tokens: the cells it attended to do not hold the sequence's K/V"
            )

    def _logits_difference(self, tokens: tuple[int, ...], logits: tuple[float, ...]) -> float:
        """The largest difference between ``logits`` and those of a fresh decode of ``tokens`` (positions
        ``0 .. len - 1``) into the empty reference context."""
        reference = self._reference
        reference.clear()
        fresh = reference.decode(0, tokens, 0)
        if fresh.status != 0:
            raise RuntimeError(f"the reference context could not decode {len(tokens)} tokens")
        return max(abs(a - b) for a, b in zip(logits, fresh.logits))

    def _remove(self, seq: SeqId, op: str) -> None:
        state = self._seqs[seq]
        if not self._context.seq_rm(state.seq_id, -1, -1):
            raise AllocatorError(f"{op}: llama_memory_seq_rm({state.seq_id}, -1, -1) returned false")
        self._drop(state.seq_id, 0)
        seq_id, state.seq_id = state.seq_id, -1  # it holds no cells now
        self._verify(f"{op}({seq!r}) (seq_rm {seq_id})")

    def _drop(self, seq_id: int, first: int) -> None:
        """``seq_rm(seq_id, first, -1)``'s documented effect: the sequence leaves its cells from position
        ``first`` on; a cell no sequence holds is empty."""
        for cell, (pos, ids) in list(self._cells.items()):
            if seq_id in ids and pos >= first:
                if ids == {seq_id}:
                    del self._cells[cell]
                else:
                    self._cells[cell] = (pos, ids - {seq_id})

    def _verify(self, call: str) -> None:
        """The picture against llama.cpp's own answers: every used cell in index order, and each sequence's
        position range (the ballast's included)."""
        order = sorted(self._cells)
        expected = [self._cells[cell] for cell in order]
        found = [(cell.pos, cell.seq_ids) for cell in self._context.used_cells()]
        if found != expected:
            first = next(i for i in range(max(len(found), len(expected))) if _at(found, i) != _at(expected, i))
            where = f"cell {order[first]}" if first < len(order) else "beyond the cells expected"
            raise AllocatorError(
                f"after {call}: llama.cpp holds {len(found)} used cells where its documented behaviour gives "
                f"{len(expected)}; used cell #{first} in index order ({where}) holds {_cell_text(_at(found, first))}, "
                f"expected {_cell_text(_at(expected, first))}"
            )
        lengths = {state.seq_id: (seq, len(state.tokens)) for seq, state in self._seqs.items() if state.seq_id >= 0}
        if self._ballast:
            lengths[self._ballast_id] = ("the ballast", self._ballast)
        for seq_id, (seq, length) in lengths.items():
            bounds = (self._context.pos_min(seq_id), self._context.pos_max(seq_id))
            if bounds != (0, length - 1):
                raise AllocatorError(
                    f"after {call}: llama.cpp's seq_pos_min/max of {seq!r} (seq {seq_id}) are {bounds}, "
                    f"but it holds {length} tokens"
                )


def _at(cells: list[tuple[int, frozenset[int]]], index: int) -> Optional[tuple[int, frozenset[int]]]:
    return cells[index] if index < len(cells) else None


def _cell_text(cell: Optional[tuple[int, frozenset[int]]]) -> str:
    return "nothing" if cell is None else f"position {cell[0]} of seq ids {sorted(cell[1])}"


def unified_cache(spec: PoolSpec) -> LlamaCppKVCache:
    """The factory: llama.cpp's unified KV cache with ``spec.num_blocks`` cells to give, block size 1; a decode is
    one micro-batch."""
    return LlamaCppKVCache(spec)


def unified_cache_micro_batches(spec: PoolSpec) -> LlamaCppKVCache:
    """The same cache with micro-batches of two tokens (n_ubatch = 2): a decode of more tokens is placed whole
    before any micro-batch runs (``llama_kv_cache::prepare``), then computed one micro-batch at a time."""
    return LlamaCppKVCache(spec, ubatch=2)
