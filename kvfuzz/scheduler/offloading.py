"""kvfuzz as the worker side of vLLM's ``OffloadingConnector``: the scheduler side is vLLM's own (configured through the
``KVTransferConfig`` of the ``VllmConfig``, :func:`kvfuzz.scheduler.vllm_build.vllm_config`); kvfuzz keeps the offload
store (CPU copies of blocks' K/V records, in kvfuzz's own representation), performs the stores and loads the
connector metadata orders, and reports their completion in the ``ModelRunnerOutput``'s ``kv_connector_output``.

The protocol, as vLLM 0.33.0's ``OffloadingConnectorWorker`` speaks it: at the start of a step, the stores ordered by
the previous step are submitted, and the step's ``jobs_to_flush`` (stores of blocks the scheduler just reallocated,
or of preempted requests) are submitted and waited for; then the step's loads are submitted; after the forward pass
the step's stores are queued for the next step. Every transfer reports its job id in
``kv_connector_worker_meta.completed_jobs`` once done; a finished async load also reports its request in
``finished_recving``. Here a transfer completes ``delay`` steps after it was submitted (0: in the step's own output;
drawn per job from the job id and the example's requests, so a replay draws the same), and with ``load_failures`` a
load may fail part-way: the blocks it did not fill are reported in ``invalid_block_ids`` (vLLM's recovery path,
``kv_load_failure_policy="recompute"``).

Invariants the worker holds vLLM to (:attr:`Check.TRANSFER`):

* a block a store reads is not written (by a step's tokens or by a load) from the step that ordered the store until
  the store completed: the scheduler must flush the store (``jobs_to_flush``) before it hands the block to a step
  that writes it;
* a block a load writes is neither read nor written by a scheduled step before the load completed;
* a load reads only chunks whose store completed.

The content check (:mod:`kvfuzz.scheduler.kv_slots`) then holds every loaded token to the reference's K/V: a store
copies the block's K/V when it completes, a load writes the chunk's copy into the block when it completes."""

from __future__ import annotations

import zlib
from typing import Any, Iterator, Optional, Union

import attrs

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.eagle import DraftWrite
from kvfuzz.scheduler.kv_slots import SlotPool, Write
from kvfuzz.scheduler.violations import Check, SchedulerViolation


@attrs.frozen
class Transfer:
    """One job of the connector's metadata, submitted: what it copies, and the step whose output reports it done."""

    job: int  # the scheduler's job id
    request: str  # the request it serves
    load: bool  # a load (offload store -> device blocks), or a store (device blocks -> offload store)
    blocks: tuple[int, ...]  # device block ids, in order
    chunks: tuple[int, ...]  # offload store chunk ids, one per block
    ordered: int  # the step whose metadata ordered it
    due: int  # the step whose output reports it complete
    filled: int  # blocks a load fills before it fails (len(blocks): it does not fail)


@attrs.frozen
class Chunk:
    """A block's K/V as a store copied it: each slot's shadow record (its K and V are the record's tag's), and its
    EAGLE head's draft K/V record (kvfuzz.scheduler.eagle; None where there is none)."""

    shadow: tuple[Optional[Write], ...]
    drafts: tuple[Optional[DraftWrite], ...]


@attrs.define
class TransferTally:
    """What the connector did in one example, for a run's summary."""

    stores: int = 0
    loads: int = 0
    failed_loads: int = 0
    late: int = 0  # transfers reported at least one step after the step that ordered them (every store is)
    flushed: int = 0  # stores the scheduler ordered flushed before a step
    sync_loads: int = 0  # the P/D connector: loads performed in the step that scheduled their request (of ``loads``)
    sends: int = 0  # the P/D connector: finished requests' blocks sent, their frees delayed until reported
    deferred: int = 0  # the P/D connector: times (block, step) a released block was seen held back for a step in flight

    def add(self, other: TransferTally) -> None:
        """Count ``other``'s transfers too."""
        for field in attrs.fields(TransferTally):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def describe(self) -> str:
        return (
            f"the offloading connector stored {self.stores} and loaded {self.loads} block range(s): "
            f"{self.failed_loads} load(s) failed part-way, {self.late} transfer(s) reported late, "
            f"{self.flushed} store(s) flushed before a step reused their blocks"
        )

    def describe_pd(self) -> str:
        """The P/D connector's line (:mod:`kvfuzz.scheduler.disaggregation`)."""
        return (
            f"the P/D connector loaded {self.loads} remote prefix(es) ({self.sync_loads} in the step that scheduled "
            f"their request) and sent {self.sends} finished request(s) (their frees delayed until reported): "
            f"{self.failed_loads} load(s) failed (part-way or whole), {self.late} transfer(s) reported late; "
            f"{self.deferred} time(s) a released block was seen held back by "
            "vLLM's deferred frees while a step reading it was in flight"
        )


def _draw(*parts: object) -> int:
    """A deterministic draw from ``parts`` (the same in every run and replay)."""
    return zlib.crc32(repr(parts).encode())


class NoConnector:
    """No KV connector: nothing is transferred, nothing is reported."""

    max_delay = 0
    drain_steps = 0  # steps the drain adds for transfers to finish: none

    def __init__(self) -> None:
        self.tally = TransferTally()  # stays zero

    def consume(self, output: Any, worker: Any, step: int) -> None:
        """Nothing ordered."""

    def holding(self) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """No blocks held for transfers."""
        return {}, {}

    def collected(self, step: int) -> None:
        """Nothing reported."""

    def failing(self, step: int) -> frozenset[str]:
        """No load fails its request."""
        return frozenset()

    def before_forward(self, output: Any, worker: Any, step: int) -> None:
        """Nothing to submit."""

    def after_forward(self, output: Any, worker: Any, step: int) -> Optional[Any]:
        return None

    def pending(self) -> bool:
        return False

    def loading(self) -> set[str]:
        return set()

    def transfers(self) -> int:
        return 0


class OffloadingWorker:
    """The worker side of the offloading connector over the worker's :class:`SlotPool`.

    Invariants: ``store`` holds a chunk's copy only once the store that wrote it completed; ``in_flight`` holds every
    submitted transfer not yet reported, ``queued`` the stores ordered by the last step, not yet submitted; no block
    in a pending store's or load's ``blocks`` has been written (or, for a load, read) by a step since it was ordered."""

    def __init__(self, setup: SchedulerSetup) -> None:
        self.max_delay = setup.transfer_delay  # the most steps a transfer completes late
        self.load_failures = setup.load_failures  # whether loads may fail part-way
        self.block_size = setup.block_size
        self.store: dict[int, Chunk] = {}  # chunk id -> its K/V records, as the last completed store copied them
        self.in_flight: dict[int, Transfer] = {}  # job id -> submitted, not yet reported
        self.queued: list[Transfer] = []  # stores ordered by the previous step, submitted at the next one's start
        self.done: set[int] = set()  # jobs in flight whose copy is already performed (flushed stores, sync loads)
        self.tally = TransferTally()

    @property
    def drain_steps(self) -> int:
        """Steps the drain adds for transfers to finish once every request did: the step that submits the stores the
        last one ordered, and the most steps they may report late."""
        return 1 + self.max_delay

    def pending(self) -> bool:
        """Whether a transfer is still to be reported (the engine keeps stepping for it)."""
        return bool(self.in_flight or self.queued)

    def transfers(self) -> int:
        """Transfers completed so far."""
        return self.tally.loads + self.tally.stores

    def loading(self) -> set[str]:
        """The requests with a load in flight."""
        return {transfer.request for transfer in self.in_flight.values() if transfer.load}

    def consume(self, output: Any, worker: Any, step: int) -> None:
        """The step's jobs are submitted in :meth:`before_forward`."""

    def holding(self) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """No blocks held for transfers beyond the requests' own (a finished request's stores are fenced)."""
        return {}, {}

    def collected(self, step: int) -> None:
        """Completions are reported by job; nothing to forget."""

    def failing(self, step: int) -> frozenset[str]:
        """No load fails its request: a failed load is recomputed (vLLM's ``recompute`` policy, the only one driven
        with this connector)."""
        return frozenset()

    # -- the step ------------------------------------------------------------------------------------------------

    def before_forward(self, output: Any, worker: Any, step: int) -> None:
        """``handle_preemptions`` and ``start_load_kv``: submit the queued stores and the flushed ones (and wait for
        the latter), submit the step's loads; then check the step's writes and reads against the transfers in
        flight."""
        meta = output.kv_connector_metadata
        flush = set(meta.jobs_to_flush or ())
        for job, entry in list(meta.store_jobs.items()):
            if job in flush:  # vLLM's worker pops a flushed store out of the step's stores and submits it now
                del meta.store_jobs[job]
                self.queued.append(self._transfer(job, entry, False, step, step))
        for transfer in self.queued:
            self.in_flight[transfer.job] = attrs.evolve(transfer, due=self._due(transfer.job, step))
        self.queued = []
        for job in sorted(flush & self.in_flight.keys()):
            self.tally.flushed += 1
            self._complete(self.in_flight[job], worker.kv)
            self.in_flight[job] = attrs.evolve(self.in_flight[job], due=step)  # done; reported in this step's output
        for job, entry in meta.load_jobs.items():
            transfer = self._transfer(job, entry, True, step, self._due(job, step))
            for chunk in transfer.chunks:
                if chunk not in self.store:
                    raise SchedulerViolation(
                        Check.TRANSFER,
                        step,
                        transfer.request,
                        f"load job {job} reads offload chunk {chunk} into block(s) {list(transfer.blocks)}, but no "
                        f"store of that chunk has completed",
                        "a load of a chunk never stored",
                    )
            self._check_load_target(transfer, step)
            self.in_flight[job] = transfer
            if entry.sync:
                self._complete(transfer, worker.kv)
                self.in_flight[job] = attrs.evolve(transfer, due=step)
        self._check_step(output, worker, step)

    def after_forward(self, output: Any, worker: Any, step: int) -> Any:
        """``wait_for_save`` and ``get_finished``: queue the step's stores for the next step's start, complete the
        transfers due now, and return the ``KVConnectorOutput`` that reports them."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput

        meta = output.kv_connector_metadata
        for job, entry in meta.store_jobs.items():
            self.queued.append(self._transfer(job, entry, False, step, step))
        report = OffloadingWorkerMetadata()
        recving: set[str] = set()
        invalid: set[int] = set()
        for job, transfer in sorted(self.in_flight.items()):
            if transfer.due > step:
                continue
            del self.in_flight[job]
            if transfer.due > transfer.ordered:
                self.tally.late += 1
            if transfer.load:
                self.tally.loads += 1
                recving.add(transfer.request)
                if transfer.filled < len(transfer.blocks):
                    self.tally.failed_loads += 1
                    invalid.update(transfer.blocks[transfer.filled :])
            else:
                self.tally.stores += 1
            self._complete(transfer, worker.kv)
            self.done.discard(job)
            report.mark_completed(job)
        return KVConnectorOutput(
            finished_recving=recving or None,
            kv_connector_worker_meta=report if report.completed_jobs else None,
            invalid_block_ids=invalid,
        )

    # -- transfers -----------------------------------------------------------------------------------------------

    def _transfer(self, job: int, entry: Any, load: bool, ordered: int, due: int) -> Transfer:
        device = entry.dst_spec if load else entry.src_spec
        offload = entry.src_spec if load else entry.dst_spec
        blocks = tuple(int(block) for block in device.block_ids)
        chunks = tuple(int(chunk) for chunk in offload.block_ids)
        if len(blocks) != len(chunks):
            raise ValueError(f"job {job}: {len(blocks)} device blocks for {len(chunks)} chunks (one block per chunk)")
        filled = len(blocks)
        if load and self.load_failures and blocks and _draw("fails", job, entry.req_id) % 4 == 0:
            filled = _draw("filled", job, entry.req_id) % len(blocks)
        return Transfer(job, entry.req_id, load, blocks, chunks, ordered, due, filled)

    def _due(self, job: int, step: int) -> int:
        """The step whose output reports job ``job``, submitted at ``step``: 0 to ``max_delay`` steps later."""
        return step + _draw("delay", job) % (self.max_delay + 1)

    def _complete(self, transfer: Transfer, kv: SlotPool) -> None:
        """Perform ``transfer``'s copy: a store copies each block's K/V records into its chunk; a load writes each
        chunk's copy into its block (a failed load only its first ``filled`` blocks)."""
        if transfer.job in self.done:
            return
        self.done.add(transfer.job)
        size = self.block_size
        pairs = list(zip(transfer.blocks, transfer.chunks))
        if transfer.load:
            for index, (block, chunk) in enumerate(pairs):
                kv.loaded.update(dict.fromkeys(range(block * size, (block + 1) * size), index < transfer.filled))
                if index >= transfer.filled:
                    continue
                copy = self.store[chunk]
                kv.shadow[block * size : (block + 1) * size] = list(copy.shadow)
                kv.set_drafts(block, copy.drafts)
            return
        for block, chunk in pairs:
            self.store[chunk] = Chunk(tuple(kv.shadow[block * size : (block + 1) * size]), kv.block_drafts(block))

    # -- the checks ----------------------------------------------------------------------------------------------

    def _check_load_target(self, load: Transfer, step: int) -> None:
        """No block ``load`` writes (from its submission on: transfers are not ordered against each other) is still
        read by a store in flight."""
        for store in [*self.in_flight.values(), *self.queued]:
            if store.load or store.job in self.done:
                continue
            for block in sorted(set(load.blocks[: load.filled]) & set(store.blocks)):
                raise SchedulerViolation(
                    Check.TRANSFER,
                    step,
                    load.request,
                    f"load job {load.job} (ordered at step {load.ordered}) writes block {block} for request "
                    f"{load.request}, which store job {store.job} (ordered at step {store.ordered} for request "
                    f"{store.request}) still reads: the store has not completed and was not flushed",
                    "a block written while its store is in flight",
                )

    def _check_step(self, output: Any, worker: Any, step: int) -> None:
        """No block the step writes has a store or a load in flight; no block the step reads has a load in
        flight."""
        pending_stores: dict[int, Transfer] = {}
        pending_loads: dict[int, Transfer] = {}
        for transfer in [*self.in_flight.values(), *self.queued]:
            if transfer.job in self.done:
                continue
            target = pending_loads if transfer.load else pending_stores
            for block in transfer.blocks:
                target.setdefault(block, transfer)
        if not pending_stores and not pending_loads:
            return
        for request, start, written, read in step_blocks(output, worker, self.block_size):
            for block in sorted(written):
                store = pending_stores.get(block)
                if store is not None:
                    raise SchedulerViolation(
                        Check.TRANSFER,
                        step,
                        request,
                        f"step {step} writes request {request}'s K/V (from position {start}) into block {block}, "
                        f"which store job {store.job} (ordered at step {store.ordered} for request {store.request}) "
                        f"still reads: the store has not completed and was not flushed before the step",
                        "a block written while its store is in flight",
                    )
            for block in sorted(read | written):
                load = pending_loads.get(block)
                if load is not None:
                    raise SchedulerViolation(
                        Check.TRANSFER,
                        step,
                        request,
                        f"step {step} schedules request {request} over block {block}, which load job {load.job} (for "
                        f"request {load.request}, ordered at step {load.ordered}) has not finished writing",
                        "a block used while its load is in flight",
                    )


def step_blocks(output: Any, worker: Any, block_size: int) -> Iterator[tuple[str, int, set[int], set[int]]]:
    """Each request a step schedules, as a connector's checks see it: the request, the position it computes from,
    the blocks of its tables the step writes, and those it reads (in an attention group every block up to its last
    scheduled token; in a Mamba group the state blocks it reads and writes)."""
    for request, count in output.num_scheduled_tokens.items():
        tables = worker.requests[request].tables
        start = worker.computed[request]
        read, written = worker.mamba.touched(tables, range(start, start + count))
        for rule in worker.groups:
            table = tables[rule.index]
            written |= {table[p // block_size] for p in range(start, start + count) if p // block_size < len(table)}
            read |= set(table[: -(-(start + count) // block_size)])
        yield request, start, written, read


def connector_for(setup: SchedulerSetup) -> Union[OffloadingWorker, NoConnector]:
    """The worker side of ``setup``'s KV connector: :class:`OffloadingWorker`, or :class:`NoConnector`."""
    return OffloadingWorker(setup) if setup.kv_connector == "offloading" else NoConnector()
