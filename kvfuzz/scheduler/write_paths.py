"""Write paths: who decides the slot each scheduled token's K/V is written to.

* :class:`OwnSlotMapping` (``kvfuzz``): kvfuzz's worker computes each slot from its own tables
  (``block * block_size + position % block_size``). Fast; it tests what the scheduler hands out, never the engine's
  own worker-side code.
* :class:`VllmV1BlockTable` and :class:`VllmV2BlockTables` (``vllm``): vLLM's own worker-side block table objects,
  kept from each ``SchedulerOutput`` as the model runner the configuration selects keeps them, compute the slot
  mapping with vLLM's own Triton kernel (Triton's interpreter on CPU tensors), and the K/V is written where vLLM
  says. The worker checks every slot against its own tables (:meth:`Worker.slots`) before it writes: a mismatch is
  a ``slot-mapping`` violation naming the request, the position, the block and slot the tables give and vLLM's.

  - the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``) keeps a ``MultiGroupBlockTable`` in its input batch: a new
    request's row is set (``add_row``), a cached request's new blocks appended (``append_row``), a resumed one's row
    replaced (``add_row``), a finished one's row cleared (``clear_row``); ``commit_block_table`` and
    ``compute_slot_mapping`` over rows ``0 .. n - 1`` with each row's scheduled positions. (The input batch's own
    row bookkeeping, ``condense`` and reordering, is kvfuzz's here: a request keeps the lowest free row from its
    admission to its removal, and rows not scheduled this step get no tokens.)
  - the V2 runner keeps ``BlockTables``: a new request gets a request index from a free list as its
    ``RequestState`` gives them (last freed first), ``append_block_ids(..., overwrite=True)``; a cached one's new
    blocks ``overwrite=False``; finished and preempted requests free their index; ``apply_staged_writes`` and
    ``compute_slot_mappings`` with ``idx_mapping`` in the step's batch order.

vLLM's worker-side buffers are written for a GPU: on kvfuzz's CPU-only vLLM (whose platform is "unspecified", and
claims pinned memory) they are built as vLLM builds them on a platform without pinned memory
(:func:`cpu_worker_buffers`)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Protocol, Sequence

from kvfuzz.scheduler.config import MODEL_SHAPE, SchedulerSetup
from kvfuzz.scheduler.vllm_release import vllm_release

Batch = Sequence[tuple[str, range]]
"""The step's scheduled requests, in order, each with the positions it computes this step."""


class WritePath(Protocol):
    """Decides the slots a step's scheduled tokens are written to."""

    name: str  # "kvfuzz" or "vllm"

    def consume(self, output: Any) -> None:
        """Keep its tables from the step's ``SchedulerOutput`` (called after the worker's own tables are updated)."""

    def slot_mapping(self, batch: Batch, step: int) -> list[list[list[int]]]:
        """For each ``(request, positions)`` of ``batch``, and each KV-cache group in order, the slots its positions'
        K/V are written to in that group."""


class SlotSource(Protocol):
    """What the write paths read of the worker: its KV-cache groups, and (for :class:`OwnSlotMapping`) its own slot
    computation."""

    @property
    def groups(self) -> Sequence[Any]:
        """The model's attention groups, in vLLM's order, each with its ``index`` among all KV-cache groups."""

    def slots(self, request: str, positions: range, step: int, group: int = 0) -> list[int]: ...


WritePathFactory = Callable[[SchedulerSetup, bool, SlotSource], WritePath]
"""Builds a write path for a configuration, the model runner's protocol (True: V2) and the worker."""


class OwnSlotMapping:
    """kvfuzz's own slot mapping: the worker's tables decide (:meth:`Worker.slots`)."""

    name = "kvfuzz"

    def __init__(self, setup: SchedulerSetup, runner_v2: bool, worker: SlotSource) -> None:
        self.worker = worker  # whose slots() computes the mapping

    def consume(self, output: Any) -> None:
        return None

    def slot_mapping(self, batch: Batch, step: int) -> list[list[list[int]]]:
        groups = [
            rule.index for rule in self.worker.groups
        ]  # the attention groups' indexes (a Mamba group may come first)
        return [
            [self.worker.slots(request, positions, step, group) for group in groups] for request, positions in batch
        ]


@functools.lru_cache(maxsize=None)
def cpu_worker_buffers() -> None:
    """Build vLLM's worker-side buffers as on a platform without pinned memory, once per process: no pinning
    (``PIN_MEMORY`` of ``vllm.v1.utils`` and ``vllm.utils.torch_utils``), the explicit-copy ``NonUvaBuffer`` for
    the V2 runner's UVA buffers, and ``cpu`` as the device those allocate on. vLLM's scheduler reads none of them.
    Triton's interpreter must have been chosen before vLLM was imported (:func:`prepare_write_path`)."""
    import vllm.utils.torch_utils as torch_utils
    import vllm.v1.utils as v1_utils
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils
    from vllm.platforms import current_platform

    v1_utils.PIN_MEMORY = False  # type: ignore[attr-defined]
    torch_utils.PIN_MEMORY = False
    buffer_utils.is_uva_available = lambda: False  # type: ignore[assignment]
    buffer_utils.is_pin_memory_available = lambda: False  # vLLM 0.34.0's NonUvaBuffer asks it rather than PIN_MEMORY
    if not current_platform.device_type:
        current_platform.device_type = "cpu"


def prepare_write_path(name: str) -> None:
    """Set the process up for write path ``name`` before vLLM is imported: vLLM's slot mapping kernels are Triton
    kernels, which run on CPU tensors in Triton's interpreter (chosen when Triton is first imported). Raises
    :class:`~kvfuzz.kernels.KernelUnavailable` (a ``ValueError``) when that is too late or Triton is missing."""
    if name == "vllm":
        from kvfuzz.kernels.vllm_triton import prepare

        prepare(MODEL_SHAPE)


def _positions(batch: Batch) -> tuple[Any, Any]:
    """``query_start_loc`` (int32, one more than the batch) and ``positions`` (int64) of a batch, as vLLM's input
    batch lays them out."""
    import torch

    starts: list[int] = [0]
    positions: list[int] = []
    for _, scheduled in batch:
        positions.extend(scheduled)
        starts.append(len(positions))
    return torch.tensor(starts, dtype=torch.int32), torch.tensor(positions, dtype=torch.int64)


def _split(flat: Sequence[Sequence[int]], batch: Batch) -> list[list[list[int]]]:
    """The flat slot mappings of a batch (one per KV-cache group), split per request: each request's slots in each
    group."""
    result, start = [], 0
    for _, scheduled in batch:
        result.append([list(group[start : start + len(scheduled)]) for group in flat])
        start += len(scheduled)
    return result


def attention_ids(block_ids: Sequence[Sequence[int]], groups: Sequence[int]) -> tuple[list[int], ...]:
    """The block ids of the attention groups (indexes ``groups`` among every KV-cache group) from a
    ``SchedulerOutput``'s per-group ids: vLLM's tables kept here map K/V slots, and a Mamba group's table holds
    state blocks, read and written by the state path (:mod:`kvfuzz.scheduler.mamba_states`), not by slot."""
    return tuple(list(block_ids[group]) for group in groups)


class VllmV1BlockTable:
    """vLLM's V1 model runner's ``MultiGroupBlockTable`` (one block table per attention group), kept as its input
    batch keeps it."""

    name = "vllm"

    def __init__(self, setup: SchedulerSetup, runner_v2: bool, worker: SlotSource) -> None:
        import torch

        cpu_worker_buffers()
        from vllm.v1.worker.block_table import MultiGroupBlockTable

        self.max_rows = setup.max_num_seqs  # the input batch's max_num_reqs
        self.table = MultiGroupBlockTable(
            max_num_reqs=self.max_rows,
            max_num_batched_tokens=setup.max_num_batched_tokens,
            pin_memory=False,
            device=torch.device("cpu"),
            block_sizes=[setup.block_size] * len(worker.groups),
            max_num_blocks=[setup.num_blocks] * len(worker.groups),
        )
        self.groups = len(worker.groups)  # attention groups, one block table each
        self.indexes = [rule.index for rule in worker.groups]  # their indexes among every KV-cache group
        self.rows: dict[str, int] = {}  # request in the input batch -> its row

    def _remove(self, request: str) -> None:
        row = self.rows.pop(request, None)
        if row is not None:
            self.table.clear_row(row)

    def _row(self, request: str) -> int:
        row = min(set(range(self.max_rows)) - set(self.rows.values()))
        self.rows[request] = row
        return row

    def consume(self, output: Any) -> None:
        for request in output.finished_req_ids:
            self._remove(request)
        for request in output.preempted_req_ids or ():  # the V1 runner drops a preempted request from its batch
            self._remove(request)
        for new in output.scheduled_new_reqs:
            self._remove(new.req_id)
            self.table.add_row(attention_ids(new.block_ids, self.indexes), self._row(new.req_id))
        cached = output.scheduled_cached_reqs
        resumed = vllm_release().resumed(cached)
        for index, request in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[index]
            if request in resumed:
                self._remove(request)
                self.table.add_row(attention_ids(blocks, self.indexes), self._row(request))
            elif blocks is not None:
                self.table.append_row(attention_ids(blocks, self.indexes), self.rows[request])

    def slot_mapping(self, batch: Batch, step: int) -> list[list[list[int]]]:
        if not batch:
            return []
        rows = max(self.rows.values()) + 1
        scheduled = dict(batch)
        by_row = {row: request for request, row in self.rows.items()}
        in_rows = [(by_row.get(row, ""), scheduled.get(by_row.get(row, ""), range(0))) for row in range(rows)]
        starts, positions = _positions(in_rows)
        self.table.commit_block_table(rows)
        self.table.compute_slot_mapping(rows, starts, positions)
        flat = [self.table[group].slot_mapping.gpu[: len(positions)].tolist() for group in range(self.groups)]
        per_request = dict(zip((request for request, _ in in_rows), _split(flat, in_rows)))
        return [per_request[request] for request, _ in batch]


class VllmV2BlockTables:
    """vLLM's V2 model runner's ``BlockTables`` (one block table per attention group), kept as its model runner keeps
    it. (Its ``sliding_window_reach`` is left off: it masks only ``gather_block_tables``, the tables attention reads,
    which kvfuzz does not drive, never the slot mapping.)"""

    name = "vllm"

    def __init__(self, setup: SchedulerSetup, runner_v2: bool, worker: SlotSource) -> None:
        import torch

        cpu_worker_buffers()
        from vllm.v1.worker.gpu.block_table import BlockTables

        self.tables = BlockTables(
            block_sizes=[setup.block_size] * len(worker.groups),
            max_num_reqs=setup.max_num_seqs,
            max_num_batched_tokens=setup.max_num_batched_tokens,
            max_num_blocks_per_group=[setup.num_blocks] * len(worker.groups),
            device=torch.device("cpu"),
        )
        self.free = list(range(setup.max_num_seqs))  # free request indices, as RequestState keeps them
        self.indexes = [rule.index for rule in worker.groups]  # the attention groups' indexes among every group
        self.index: dict[str, int] = {}  # request the runner holds -> its request index

    def _remove(self, request: str) -> None:
        index = self.index.pop(request, None)
        if index is not None:
            self.free.append(index)

    def consume(self, output: Any) -> None:
        for request in sorted(set(output.finished_req_ids) | set(output.preempted_req_ids or ())):
            self._remove(request)
        for new in output.scheduled_new_reqs:
            self._remove(new.req_id)
            self.index[new.req_id] = self.free.pop()
            self.tables.append_block_ids(
                self.index[new.req_id], attention_ids(new.block_ids, self.indexes), overwrite=True
            )
        cached = output.scheduled_cached_reqs
        for index, request in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[index]
            if blocks is not None:
                self.tables.append_block_ids(self.index[request], attention_ids(blocks, self.indexes), overwrite=False)
        self.tables.apply_staged_writes()

    def slot_mapping(self, batch: Batch, step: int) -> list[list[list[int]]]:
        import torch

        if not batch:
            return []
        starts, positions = _positions(batch)
        mapping = torch.tensor([self.index[request] for request, _ in batch], dtype=torch.int32)
        flat = self.tables.compute_slot_mappings(mapping, starts, positions, len(positions)).tolist()
        return _split(flat, batch)


def vllm_write_path(setup: SchedulerSetup, runner_v2: bool, worker: SlotSource) -> WritePath:
    """vLLM's own slot mapping, through the block table objects of the model runner its configuration selects."""
    if runner_v2:
        return VllmV2BlockTables(setup, runner_v2, worker)
    return VllmV1BlockTable(setup, runner_v2, worker)


WRITE_PATHS: dict[str, WritePathFactory] = {"kvfuzz": OwnSlotMapping, "vllm": vllm_write_path}
"""The write paths ``kvfuzz run --scheduler --write-path`` names."""
