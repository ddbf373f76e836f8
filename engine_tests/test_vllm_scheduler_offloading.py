"""vLLM's OffloadingConnector (scheduler side, vLLM's code) with kvfuzz as its worker side: the unmodified connector
passes with stores, loads, flushes, late transfers and failed loads reached; each seeded worker bug is caught."""

from __future__ import annotations

import random
import weakref
from pathlib import Path
from typing import Any

import attrs
import pytest
from vllm_versions import V1_RUNNER

from kvfuzz.scheduler import offloading
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.replay_result import RunnerUnavailable
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.trace import load
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


CORPUS = Path(__file__).parent.parent / "corpus"
RELOAD_HANG = CORPUS / "vllm-v1-scheduler-offloading-one-token-reload-hang-29b8f30c1dd1.json"
WAITING_HOLDS = CORPUS / "vllm-v1-scheduler-offloading-waiting-queue-holds-blocks-a8dffbbfe266.json"
LOAD_GATE = CORPUS / "vllm-v1-scheduler-offloading-load-gate-hang-99d75d3823f8.json"
LOAD_GATE_V2 = CORPUS / "vllm-v1-scheduler-offloading-load-gate-hang-v2-c7697394cd8d.json"
"""The same program recorded under the V2 runner's protocol, which every tested vLLM has."""


def asked_once_after_its_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fix for the one-token reload hang, patched in: the scheduler does not ask the connector again for a request
    whose async load it just finished (what ``num_computed_tokens == 0`` is meant to tell, and does not when a
    full-prompt hit of one token is rewound to 0), so the request is scheduled for its one token, in the block its
    load filled."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.core.sched.scheduler import Scheduler

    promoted: weakref.WeakSet[Any] = weakref.WeakSet()  # the requests themselves: ids repeat across sessions
    promote, matched = Scheduler._update_waiting_for_remote_kv, OffloadingConnector.get_num_new_matched_tokens

    def update_waiting_for_remote_kv(self: Any, request: Any) -> None:
        promoted.add(request)
        promote(self, request)

    def get_num_new_matched_tokens(self: Any, request: Any, num_computed_tokens: int) -> Any:
        if request in promoted:
            promoted.discard(request)
            return 0, False
        return matched(self, request, num_computed_tokens)

    monkeypatch.setattr(Scheduler, "_update_waiting_for_remote_kv", update_waiting_for_remote_kv)
    monkeypatch.setattr(OffloadingConnector, "get_num_new_matched_tokens", get_num_new_matched_tokens)


def test_a_one_token_prompt_found_whole_in_the_offload_store_is_reloaded_forever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A finding in vLLM 0.33.0 as released (docs/scheduler-connectors.md): block size 1, r0 = [0] runs and its
    block is stored; r1 = [0] finds the chunk, waits for its load, is rewound to 0 computed tokens (a full-prompt hit
    recomputes its last token) and is then looked up again as if new: another load, and so on. The progress check,
    replayed word for word from the corpus; the session shows the reloads; with the fix patched in the program
    passes."""
    trace = load(RELOAD_HANG)
    assert trace.known_bug and trace.setup.block_size == 1
    found = replay(trace)
    assert found.reproduced and found.identical, found.describe_failure()
    assert found.describe_failure() == (
        "progress check failed at step 25, request r1: 1 request(s) still unfinished 24 steps after arrivals "
        "stopped: r1 (WAITING_FOR_REMOTE_KVS, 1 computed, 0 of 1 output tokens)"
    )
    session = Session(trace.setup)
    session.add([0], 1)
    session.step()
    session.add([0], 1)
    with pytest.raises(SchedulerViolation, match="r1 \\(WAITING_FOR_REMOTE_KVS"):
        session.drain()
    assert session.connector.tally.loads > 5  # one load would do: r1 is loaded again and again
    asked_once_after_its_load(monkeypatch)
    assert not replay(trace).failed


def test_the_reloaded_request_waits_in_the_queue_for_requests_without_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same vLLM bug seen by the accounting check: the rewound request's new lookup is delayed (another request
    loads the same chunk), and schedule() queues it by ``_holds_kv_blocks`` (0 computed tokens: none) in the waiting
    queue while it holds the block its load filled. Word for word from the corpus; with the fix it passes."""
    trace = load(WAITING_HOLDS)
    assert trace.known_bug
    found = replay(trace)
    assert found.reproduced and found.identical, found.describe_failure()
    assert found.describe_failure().endswith(
        "blocks neither free nor in a table: [2]; block 2 in vLLM's own table for r2 (WAITING, 0 computed, in "
        "vLLM's waiting queue, for requests that hold no blocks by vLLM's _holds_kv_blocks)"
    )
    asked_once_after_its_load(monkeypatch)
    assert not replay(trace).failed


def test_an_async_load_whose_admission_asks_more_than_the_idle_pool_never_runs() -> None:
    """A second finding in vLLM 0.33.0 (docs/scheduler-connectors.md): with 1 draft on 3 blocks of 1 slot, r1 =
    [0, 0] finds one token locally and one in the offload store; the async-load admission gate reserves the draft
    step's blocks on top of the request's, more than the idle pool, at every step. Word for word from the corpus;
    the same program runs without drafts, without the connector, and on 4 blocks."""
    trace = load(LOAD_GATE)
    assert trace.known_bug and trace.setup.speculative_tokens == 1 and trace.setup.num_blocks == 3
    hang = (
        "progress check failed at step 29, request r1: 1 request(s) still unfinished 28 steps after arrivals "
        "stopped: r1 (WAITING, 0 computed, 0 of 1 output tokens)"
    )
    if V1_RUNNER:  # recorded under the V1 runner's protocol
        found = replay(trace)
        assert found.reproduced and found.identical and found.describe_failure() == hang, found.describe_failure()
    else:  # vLLM 0.34.0 removed Model Runner V1: the trace is refused in one line (the plugin skips it, saying so)
        with pytest.raises(RunnerUnavailable, match="recorded with vLLM's V1 model runner, and this vLLM selects V2"):
            replay(trace)
    # the same program under V2's protocol (its own corpus trace): the bug is there in both releases
    v2 = load(LOAD_GATE_V2)
    assert v2.program == trace.program and v2.setup == trace.setup and v2.model_runner == "V2"
    found = replay(v2)
    assert found.reproduced and found.describe_failure() == hang, found.describe_failure()
    for setup in (
        attrs.evolve(trace.setup, speculative_tokens=0),
        attrs.evolve(trace.setup, kv_connector="none"),
        attrs.evolve(trace.setup, num_blocks=4),
    ):
        assert not replay(attrs.evolve(v2, setup=setup)).failed, setup


def test_building_a_scheduler_with_the_connector_prints_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's connector base class warns that its API is experimental each time a connector is built (once per
    example: hundreds of lines in a campaign); kvfuzz quiets its logger while it builds the scheduler, and only
    then."""
    import logging

    from kvfuzz.scheduler.vllm_build import CONNECTOR_LOGGER, new_scheduler

    before = logging.getLogger(CONNECTOR_LOGGER).level
    with caplog.at_level(logging.DEBUG):  # every record that reaches the root logger is kept
        new_scheduler(SETUP)
    assert not [record for record in caplog.records if "KVConnectorBase_V1" in record.getMessage()]
    assert logging.getLogger(CONNECTOR_LOGGER).level == before


def test_a_store_the_offload_store_has_no_room_for_is_not_logged() -> None:
    """The connector's scheduler warns of every store its offload store has no room for (an outcome kvfuzz's small
    stores reach on purpose, hundreds of times in a campaign); that warning alone is filtered out."""
    import logging

    from kvfuzz.scheduler.vllm_build import vllm

    vllm()  # installs kvfuzz's filters on vLLM's loggers
    logger = logging.getLogger("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler")

    def record(message: str) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 0, message, ("r0",), None)

    assert not logger.filter(record("Request %s: cannot store chunks"))
    assert logger.filter(record("Request %s: something else"))


RESETS = SchedulerSetup(kv_connector="offloading", prefix_resets=True)
PROMPT = [1, 2, 3, 0, 2, 2, 1, 3, 0]  # two full blocks of 4 and a token


def finish(session: Session, request: str) -> None:
    while request in session.outputs.unfinished():
        session.step()


def stored_then_reset(session: Session) -> None:
    """A request runs, finishes and is stored in the offload store; the client then resets the prefix cache."""
    finish(session, session.add(PROMPT, 1))
    session.step()
    session.step()  # the finish reaches the worker, the stores complete
    assert session.connector.tally.stores > 0
    assert session.reset_prefix_cache() is True and session.resets.epoch == 1


def test_a_reset_clears_the_offload_store_too_and_nothing_stored_before_it_is_loaded() -> None:
    session = Session(RESETS)
    stored_then_reset(session)
    loads = session.connector.tally.loads
    finish(session, session.add(PROMPT[:-1] + [3], 1))  # the same two blocks: a hit in the store before the reset
    assert session.connector.tally.loads == loads and session.hit_tokens == 0
    session.drain()


def test_a_connector_reset_that_keeps_the_store_is_caught_by_the_content_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: vLLM's scheduler reports the connector's store reset without resetting it, so the offloading
    connector loads K/V computed under the weights before the reset."""
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "reset_connector_cache", lambda self: True)
    session = Session(RESETS)
    stored_then_reset(session)
    with pytest.raises(SchedulerViolation) as caught:
        finish(session, session.add(PROMPT[:-1] + [3], 1))
    assert caught.value.check == Check.CONTENT
    assert "holds the K/V of request r0's position 0" in str(caught.value)


def test_a_preempting_reset_during_a_load_is_refused_as_vllm_says_and_the_requests_finish() -> None:
    """vLLM raises rather than reset while a request waits for a KV load ("not supported yet"): kvfuzz counts it
    as a refusal, the engine goes on, and the request finishes with its K/V checked."""
    session = Session(attrs.evolve(RESETS, transfer_delay=2))
    session.add([0, 1, 2, 0], 1)
    for _ in range(3):
        session.step()  # it runs, finishes, and its block is stored
    waiting = session.add([0, 1, 2, 0], 1)
    session.step()  # a hit in the offload store: an async load in flight
    assert session.scheduler.requests[waiting].status.name == "WAITING_FOR_REMOTE_KVS"
    assert session.reset_prefix_cache(preempt=True) is False and session.resets.refused == 1
    finish(session, waiting)
    session.drain()


SECOND_RESET = Path(__file__).parent / "data" / "offloading-second-reset-assertion.json"


def test_a_second_reset_before_a_step_fails_vllm_0_33_0s_assertion_and_passes_on_0_34_0() -> None:
    """The bug kvfuzz met once resets reset the connector's store (engine_tests/data: the standalone reproducer
    plays no connector): on 0.33.0 the recorded AssertionError word for word, on 0.34.0 (which fixed it) a clean
    replay."""
    from kvfuzz.scheduler.engines import installed_version

    trace = load(SECOND_RESET)
    assert trace.known_bug and "fixed in 0.34.0" in trace.known_bug
    replayed = replay(trace)
    if installed_version("vllm") == "0.33.0":
        assert replayed.reproduced and replayed.identical, replayed.describe_failure()
    else:
        assert not replayed.reproduced and replayed.failure is None, replayed.describe_failure()
