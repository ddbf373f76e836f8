"""vLLM's OffloadingConnector (scheduler side, vLLM's code) with kvfuzz as its worker side: the unmodified connector
passes with stores, loads, flushes, late transfers and failed loads reached; each seeded worker bug is caught."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvfuzz.scheduler import offloading
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.violations import Check, SchedulerViolation

SETUP = SchedulerSetup(num_blocks=8, block_size=2, kv_connector="offloading", transfer_delay=2, load_failures=True)


def run_examples(setup: SchedulerSetup, examples: int) -> offloading.TransferTally:
    """Random request programs (shared prefixes, aborts, a small pool), each drained; the summed transfer tally."""
    total = offloading.TransferTally()
    for example in range(examples):
        rng = random.Random(example)
        session = Session(setup)
        for _ in range(30):
            draw = rng.random()
            if draw < 0.35:
                prompt = [1, 2, 3, 1, 2, 3, 1, 2][: rng.randint(3, 8)] + [rng.randint(0, 3)] * rng.randint(0, 2)
                session.add(prompt, rng.randint(1, 4))
            elif draw < 0.4 and session.lengths:
                session.abort(f"r{rng.randrange(len(session.lengths))}")
            else:
                session.step()
        session.drain()
        tally = session.connector.tally
        total.stores += tally.stores
        total.loads += tally.loads
        total.failed_loads += tally.failed_loads
        total.late += tally.late
        total.flushed += tally.flushed
    return total


def test_the_unmodified_connector_passes_with_every_transfer_kind_reached() -> None:
    tally = run_examples(SETUP, 12)
    assert tally.stores > 0 and tally.loads > 0 and tally.failed_loads > 0 and tally.flushed > 0 and tally.late > 0


class NoFlush(offloading.OffloadingWorker):
    """Seeded worker bug: the step's ``jobs_to_flush`` are not waited for (the stores stay in flight)."""

    def before_forward(self, output: Any, worker: Any, step: int) -> None:
        output.kv_connector_metadata.jobs_to_flush = set()
        super().before_forward(output, worker, step)


class WrongChunk(offloading.OffloadingWorker):
    """Seeded worker bug: a store copies each block into the chunk of the next block of its job."""

    def _transfer(self, job: int, entry: Any, load: bool, ordered: int, due: int) -> offloading.Transfer:
        transfer = super()._transfer(job, entry, load, ordered, due)
        if load or len(transfer.chunks) < 2:
            return transfer
        return offloading.Transfer(
            transfer.job,
            transfer.request,
            load,
            transfer.blocks,
            transfer.chunks[1:] + transfer.chunks[:1],
            transfer.ordered,
            transfer.due,
            transfer.filled,
        )


@pytest.mark.parametrize(("bug", "check"), [(NoFlush, Check.TRANSFER), (WrongChunk, Check.CONTENT)])
def test_a_seeded_worker_bug_is_caught(monkeypatch: pytest.MonkeyPatch, bug: type, check: Check) -> None:
    monkeypatch.setattr("kvfuzz.scheduler.session.connector_for", bug)
    with pytest.raises(SchedulerViolation) as caught:
        run_examples(SETUP, 12)
    assert caught.value.check is check, str(caught.value)


def test_late_transfers_need_a_connector() -> None:
    with pytest.raises(ValueError, match="need a KV connector"):
        SchedulerSetup(transfer_delay=1)
    with pytest.raises(ValueError, match="only with synchronous scheduling"):
        SchedulerSetup(kv_connector="offloading", async_scheduling=True)


def test_a_connector_that_forgets_finished_requests_fences_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded vLLM bug: the connector's scheduler side does not fence the blocks of a finished request's stores in
    flight (``request_finished`` registers no deferred fence), so a store still reading a block the scheduler hands
    to another request is not flushed before that block is written."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler

    finished = OffloadingConnectorScheduler.request_finished

    def unfenced(self: Any, request: Any) -> Any:
        status = self._req_status.get(request.request_id)
        for job in status.transfer_jobs if status is not None else ():
            self._jobs[job].deferred_fence_block_ids = None
        return finished(self, request)

    monkeypatch.setattr(OffloadingConnectorScheduler, "request_finished", unfenced)
    with pytest.raises(SchedulerViolation) as caught:
        run_examples(SETUP, 12)
    assert caught.value.check is Check.TRANSFER, str(caught.value)
    assert "store job" in str(caught.value)
