"""The policy oracles (docs/oracles.md): each catches a bug seeded into vLLM's v1 scheduler
(engine_tests/vllm_oracle_bugs.py) that breaks no KV-cache invariant, from random requests, with its own verdict and
message; and the same derandomized searches pass on vLLM as released.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``); without vLLM the import fails loudly."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from engine_tests import vllm_oracle_bugs as bugs
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.trace import from_json
from kvfuzz.scheduler.violations import Check

FCFS = SchedulerSetup(num_blocks=8)  # a pool small enough that requests wait and are preempted
PRIORITY = SchedulerSetup(num_blocks=8, policy="priority")
OVERLONG = SchedulerSetup(overlong_requests=True)  # requests that run into max_model_len
LONG_PREFILL = SchedulerSetup(num_blocks=8, long_prefill_token_threshold=3)  # prompts beside others take 3 a step
ADAPTIVE = SchedulerSetup(num_blocks=8, long_prefill_token_threshold=2, long_prefill_token_threshold_adaptive=True)
ACTIVE = SchedulerSetup(num_blocks=8, max_num_active_seqs=2)  # two of the four runner slots admitted
CADENCE = SchedulerSetup(num_blocks=8, prefill_schedule_interval=3)  # prefill every third step while decodes run
PAUSES = SchedulerSetup(num_blocks=8, pauses=True)  # the client pauses and unpauses the scheduler
UNCHUNKED = SchedulerSetup(num_blocks=8, chunked_prefill=False)  # prompts scheduled whole (max_model_len 16)
UNCHUNKED_ASYNC = SchedulerSetup(num_blocks=8, chunked_prefill=False, async_scheduling=True, speculative_tokens=2)
EXAMPLES = 60  # each bug is found within its first 20 examples
STEPS = 50

CASES: list[tuple[Callable[[pytest.MonkeyPatch], None], SchedulerSetup, Check, str]] = [
    (
        bugs.fcfs_victim_requeued_at_the_back,
        FCFS,
        Check.ORDER,
        r"the step admits (r\d+, )*r\d+ but not r\d+, which is ahead of (it|them) in the waiting queue \(front first: "
        r"[^)]*\), and nothing held r\d+ back .*: under FCFS waiting requests are admitted in arrival order, a "
        r"preempted request back at the front",
    ),
    (
        bugs.fcfs_victim_admitted_early,
        FCFS,
        Check.ORDER,
        r"the step preempts (r\d+, )*r\d+ of the running requests [^(]* \(in admission order\), but leaves "
        r"(r\d+, )*r\d+ running, admitted after r\d+: under FCFS the victims are the running requests admitted last",
    ),
    (
        bugs.priority_victim_is_the_last_admitted,
        PRIORITY,
        Check.ORDER,
        r"the step preempts r\d+ \(priority \d, arrival \d+\).* but leaves r\d+ \(priority \d, arrival \d+\) running: "
        r"under the priority policy the victim is the running request of the lowest priority",
    ),
    (
        bugs.waiting_heap_by_arrival_alone,
        PRIORITY,
        Check.ORDER,
        r"the step admits .* but not r\d+, which is ahead of (it|them) in the waiting queue \(in \(priority, "
        r"arrival\) order: .*under the priority policy waiting requests are admitted in \(priority, arrival\) order",
    ),
    (
        bugs.budget_one_block_larger,
        FCFS,
        Check.BUDGET,
        r"the step schedules (1[7-9]|20) tokens \(.*\), but max_num_batched_tokens is 16",
    ),
    (
        bugs.chunked_prefill_read_as_on,
        UNCHUNKED,
        Check.BUDGET,
        r"the step admits it with \d+ of the \d+ tokens it has left to compute \(positions \d+\.\.\d+ of its \d+\), "
        r"but chunked prefill is off \(enable_chunked_prefill=False\): vLLM schedules a waiting request.s prompt "
        r"whole, or not at all",
    ),
    (
        bugs.chunked_prefill_read_as_on,
        UNCHUNKED_ASYNC,
        Check.BUDGET,
        r"the step admits it with \d+ of the \d+ tokens it has left to compute .*but chunked prefill is off",
    ),
    (
        bugs.running_cap_one_more,
        FCFS,
        Check.BUDGET,
        r"the step (schedules|leaves running) 5 requests \(.*\), but max_num_seqs is 4",
    ),
    (
        bugs.long_prefill_cap_doubled,
        LONG_PREFILL,
        Check.BUDGET,
        r"the step schedules [4-6] tokens for r\d+ beside [1-3] other request\(s\) \(.*\), but "
        r"long_prefill_token_threshold caps a request at 3 tokens a step while others are in the engine",
    ),
    (
        bugs.adaptive_floor_by_running_alone,
        ADAPTIVE,
        Check.BUDGET,
        r"the step schedules \d+ tokens for r\d+ beside [1-3] other request\(s\) \(.*\), but "
        r"long_prefill_token_threshold caps a request at \d+ tokens a step, floored at max_num_batched_tokens 16 // "
        r"[2-4] scheduled requests \(adaptive\)",
    ),
    (
        bugs.active_cap_one_more,
        ACTIVE,
        Check.BUDGET,
        r"the step leaves 3 requests running \(.*\), but max_num_active_seqs is 2",
    ),
    (
        bugs.pause_ignored,
        PAUSES,
        Check.PAUSE,
        r"the client paused (new requests \(PAUSED_NEW, the engine core's 'wait' mode\), but the step admits r\d+"
        r"|the scheduler \(PAUSED_ALL, the engine core's 'keep' mode\), but the step schedules \d+ tokens)",
    ),
    (
        bugs.paused_new_admits_waiting,
        PAUSES,
        Check.PAUSE,
        r"the client paused new requests \(PAUSED_NEW, the engine core's 'wait' mode\), but the step admits "
        r"(r\d+, )*r\d+ from the waiting queue: only the running requests, and those waiting with KV blocks already "
        r"loaded, go on until the client unpauses",
    ),
    (
        bugs.model_length_one_block_longer,
        OVERLONG,
        Check.BUDGET,
        r"the step schedules its positions \d+\.\.\d+ and samples its token at position (6[4-9]|7\d), but "
        r"max_model_len is 64",
    ),
    (
        bugs.resumed_request_held_from_decoding,
        FCFS,
        Check.LIVENESS,
        r"the step leaves it running without scheduling it, though it left \d+ of max_num_scheduled_tokens 16 "
        r"unspent",
    ),
    (
        bugs.admission_only_when_idle,
        FCFS,
        Check.LIVENESS,
        r"it is first in the waiting queue \(.*\) and the step did not admit it, though the step left room for all "
        r"of it: [1-3] of max_num_seqs 4 running",
    ),
]


@pytest.mark.parametrize(
    ("seed_bug", "setup", "check", "message"),
    CASES,
    ids=[case[0].__name__ + ("-async" if case[1].async_scheduling else "") for case in CASES],
)
def test_each_seeded_bug_is_caught_by_its_oracle(
    seed_bug: Callable[[pytest.MonkeyPatch], None],
    setup: SchedulerSetup,
    check: Check,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seed_bug(monkeypatch)
    outcome = search(setup, examples=EXAMPLES, steps=STEPS, shrink=False)
    assert outcome.check() == check.value, outcome.explanation()
    assert re.search(message, outcome.explanation()), outcome.explanation()


@pytest.mark.parametrize(
    "setup",
    [FCFS, PRIORITY, OVERLONG, LONG_PREFILL, ADAPTIVE, ACTIVE, CADENCE, PAUSES, UNCHUNKED, UNCHUNKED_ASYNC],
    ids=[
        "fcfs",
        "priority",
        "overlong",
        "long-prefill",
        "adaptive",
        "active",
        "cadence",
        "pauses",
        "unchunked",
        "unchunked-async",
    ],
)
def test_the_same_searches_pass_on_vllm_as_released(setup: SchedulerSetup) -> None:
    """Without a seeded bug every search above runs all its examples clean, through preemptions and waiting."""
    outcome = search(setup, examples=EXAMPLES, steps=STEPS, shrink=False)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.examples >= EXAMPLES and outcome.preemptions > 0, outcome.describe()


WAITS_FOR_THE_CONNECTOR = {
    "format": "kvfuzz-scheduler-trace/1",
    "kvfuzz_version": "0.1.0",
    "scheduler": "vllm-v1",
    "engine": {"vllm_version": "0.33.0", "model_runner": "V2"},
    "config": {
        "num_blocks": 12,
        "block_size": 4,
        "max_num_batched_tokens": 12,
        "max_num_seqs": 4,
        "prefix_caching": False,
        "policy": "priority",
        "kv_connector": "offloading",
        "transfer_delay": 1,
        "overlong_requests": True,
    },
    "shrunk": True,
    "failure": {"check": "liveness", "exception": None, "step": 20, "request": "r5", "message": "(recorded)"},
    "known_bug": None,
    "program": [
        {"op": "add", "prompt": [0, 0, 0, 0, 0, 0], "max_tokens": 43},
        *[{"op": "step"}] * 17,
        {"op": "add", "prompt": [0, 1, 2, 0], "max_tokens": 1},
        {"op": "step"},
        {"op": "step"},
        {"op": "add", "prompt": [0], "max_tokens": 1},
        {"op": "add", "prompt": [0], "max_tokens": 1},
        {"op": "add", "prompt": [0, 1, 2, 0, 1, 2, 0, 1, 0], "max_tokens": 1},
        {"op": "add", "prompt": [0, 0, 0, 0], "max_tokens": 1},
        {"op": "step"},
    ],
}
"""A program a campaign found, on which the liveness oracle once named r5 (the waiting head, with room) at step 20:
vLLM passed it over because the offloading connector's lookup answered an asynchronous load, and vLLM admits one
only if its blocks fit beside what the loads already in flight still need. A KV connector's decisions are the
connector's, so with one the head-admitted promise is not held (docs/oracles.md)."""


def test_a_request_waiting_for_the_connector_is_no_liveness_violation() -> None:
    trace = from_json(WAITS_FOR_THE_CONNECTOR)
    ran: list[int] = []
    replayed = replay(trace, on_operation=lambda index, operation: ran.append(index))
    assert replayed.error is None, replayed.describe_failure()
    assert len(ran) == len(trace.program), "every operation ran, past the step the oracle once failed at"


SERVED_AHEAD = {
    "format": "kvfuzz-scheduler-trace/1",
    "kvfuzz_version": "0.1.0",
    "scheduler": "vllm-v1",
    "engine": {"vllm_version": "0.33.0", "model_runner": "V2"},
    "config": {
        "num_blocks": 8,
        "block_size": 4,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 4,
        "prefix_caching": True,
        "kv_connector": "offloading",
        "transfer_delay": 2,
    },
    "shrunk": True,
    "failure": {"check": "order", "exception": None, "step": 13, "request": "r8", "message": "(recorded)"},
    "known_bug": None,
    "program": [
        {"op": "add", "prompt": [0], "max_tokens": 1},
        {"op": "add", "prompt": [0], "max_tokens": 7},
        {"op": "add", "prompt": [0, 1, 2, 0, 1, 2, 0, 1, 0, 0, 0, 0, 0, 0, 0], "max_tokens": 7},
        {"op": "step"},
        {"op": "step"},
        {"op": "add", "prompt": [0, 1, 2, 0], "max_tokens": 2},
        {"op": "add", "prompt": [0], "max_tokens": 5},
        {"op": "add", "prompt": [0], "max_tokens": 5},
        {"op": "add", "prompt": [0], "max_tokens": 5},
        {"op": "add", "prompt": [0, 0, 0], "max_tokens": 5},
        {"op": "add", "prompt": [0, 1, 2, 0, 1, 2, 0], "max_tokens": 4},
    ],
}
"""A program a random search found, on which the order oracle once said that step 13 preempted r8 but left r3
running, "admitted after r8": r3's blocks were filled by the offloading connector's load, and vLLM serves such a
request from the connector's queue ahead of the waiting queue, so it joined the running queue before the requests
admitted beside it (r6, r7, r8), and r8 was rightly the last. The queue model now puts such requests first."""


def test_a_request_served_from_the_connectors_queue_runs_ahead_of_those_admitted_beside_it() -> None:
    trace = from_json(SERVED_AHEAD)
    replayed = replay(trace)
    assert replayed.error is None, replayed.describe_failure()
