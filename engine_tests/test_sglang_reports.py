"""``kvfuzz report`` of every SGLang trace in corpus/ that shows a real SGLang bug: the standalone reproducer it writes
runs in SGLang's environment with kvfuzz not importable (engine_tests/standalone.py) and fails with the recorded
check: the radix cache's traces (kvfuzz.adapters.sglang:radix_cache_lora, the lora_id/extra_key collision) with the
reproducer's cache-soundness or content Failure; the scheduler's hangs (kvfuzz.reproducers.sglang_scheduler) with
``Failure: progress`` naming the waiting request and PrefillAdder's verdict on it, the numbers of the known bug. The
same reproducer serves a request just inside each bug's edge, so it states the hang, not a failure of its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine_tests.standalone import (
    CORPUS,
    check_allocator_failure,
    real_bugs,
    report,
    run_without_kvfuzz,
    trace_json,
)
from kvfuzz.reproducers import scheduler_reproducer_source
from kvfuzz.scheduler.trace import load

RADIX_CACHE_BUGS = real_bugs("sglang-radix-cache-*.json")

SCHEDULER_BUGS = real_bugs("sglang-scheduler-*.json")

VERDICTS = {
    "sglang-scheduler-ignore-eos-clip-hang-47fe19becd38.json": [
        "token pool: 24 of 24 tokens free (6 pages of 4)",
        "max_new_tokens 7 asked, 7 after init_req_max_new_tokens, ignore_eos True",
        "returned NO_TOKEN: add_one_req_ignore_eos (ignore_eos, radix cache disabled): of cur_rem_tokens 24, the paged "
        "input ceil_paged_tokens(9) + per_req_token_overhead 4 = 16 and the 7 output tokens left leave 1, which must "
        "exceed IGNORE_EOS_RESERVE_TOKENS 1",
    ],
    "sglang-scheduler-page-overhead-hang-935382078725.json": [
        "token pool: 48 of 48 tokens free (3 pages of 16)",
        "prompt 32 tokens (validate_input_length accepts fewer than max_req_input_len 42; max_req_len 47)",
        "returned NO_TOKEN: add_one_req: total_tokens = extend 32 (prefix hit 0) + max_new 0 + per_req_token_overhead "
        "16 = 48, which must be below rem_total_tokens 48",
    ],
    "sglang-scheduler-page-overhead-no-radix-hang-4b98120c1497.json": [
        "token pool: 24 of 24 tokens free (3 pages of 8)",
        "prompt 17 tokens (validate_input_length accepts fewer than max_req_input_len 18; max_req_len 23)",
        "max_new_tokens 7 asked, 0 after init_req_max_new_tokens, ignore_eos False",
        "returned NO_TOKEN: add_one_req: total_tokens = extend 17 (prefix hit 0) + max_new 0 + per_req_token_overhead "
        "8 = 25, which must be below rem_total_tokens 24",
    ],
}
"""What each hang's reproducer prints, in SGLang's terms: the arithmetic of the trace's known_bug (docs/sglang.md)."""

INSIDE_THE_EDGE = {
    "sglang-scheduler-ignore-eos-clip-hang-47fe19becd38.json": [
        {"op": "add", "prompt": [0, 1, 2, 0, 1, 2, 0, 1, 0], "max_tokens": 6},  # one below the clip: 2 tokens left
        {"op": "add", "prompt": [0, 1, 2, 0, 1, 2, 0, 1, 0], "max_tokens": 7, "eos": True},  # add_one_req admits it
    ],
    "sglang-scheduler-page-overhead-hang-935382078725.json": [
        {"op": "add", "prompt": [0, 1, 2] * 10 + [0], "max_tokens": 1},  # 31 tokens: admitted, prefill-only
    ],
    "sglang-scheduler-page-overhead-no-radix-hang-4b98120c1497.json": [
        {"op": "add", "prompt": [0, 1, 2] * 5, "max_tokens": 7, "eos": True},  # 15 tokens: 15 + 0 + 8 < 24, admitted
    ],
}
"""Programs beside each hang that SGLang serves (docs/sglang.md): one at a time, each must finish."""


def test_the_radix_cache_bugs_are_the_three_findings_lists() -> None:
    assert RADIX_CACHE_BUGS == [
        "sglang-radix-cache-lora-cache-soundness-d851dea53690.json",
        "sglang-radix-cache-lora-content-417691461a2b.json",
        "sglang-radix-cache-lora-readmit-d51fce9c8732.json",
    ]


@pytest.mark.parametrize("name", RADIX_CACHE_BUGS)
def test_the_reproducer_of_a_radix_cache_bug_fails_without_kvfuzz(name: str, tmp_path: Path) -> None:
    check_allocator_failure(name, run_without_kvfuzz(report(name, tmp_path)))


def test_the_scheduler_bugs_are_the_three_findings_lists() -> None:
    assert SCHEDULER_BUGS == sorted(VERDICTS) == sorted(INSIDE_THE_EDGE)


@pytest.mark.parametrize("name", SCHEDULER_BUGS)
def test_the_reproducer_of_a_scheduler_hang_fails_without_kvfuzz(name: str, tmp_path: Path) -> None:
    ran = run_without_kvfuzz(report(name, tmp_path))
    assert ran.returncode == 1, ran.stdout + ran.stderr[-3000:]
    assert "kvfuzz is importable" not in ran.stderr
    failure = trace_json(name)["failure"]
    message = ran.stderr[ran.stderr.rfind("\nFailure: ") + 1 :]
    assert message.startswith("Failure: progress: 1 request(s) accepted and unfinished"), ran.stderr[-3000:]
    assert f"scheduled nothing: {failure['request']} waiting (1 of 1 in the queue)" in message, message
    assert "running batch: 0 request(s); chunked request: none" in message, message
    assert f"PrefillAdder.add_one_req({failure['request']}) returned NO_TOKEN" in message, message
    for words in VERDICTS[name]:
        assert words in message, (words, message)


def _variant(name: str, program: dict[str, Any], directory: Path) -> Path:
    """The reproducer of the trace ``name`` with ``program`` instead of its own."""
    data = trace_json(name)
    data.update(program=[program], known_bug=None)
    trace = directory / "variant.json"
    trace.write_text(json.dumps(data))
    reproducer = directory / "variant_reproducer.py"
    reproducer.write_text(scheduler_reproducer_source(load(trace), str(trace)))
    return reproducer


@pytest.mark.parametrize(
    "name, index", [(name, index) for name in sorted(INSIDE_THE_EDGE) for index in range(len(INSIDE_THE_EDGE[name]))]
)
def test_the_same_reproducer_serves_a_request_inside_the_edge(name: str, index: int, tmp_path: Path) -> None:
    assert (CORPUS / name).exists()
    ran = run_without_kvfuzz(_variant(name, INSIDE_THE_EDGE[name][index], tmp_path))
    assert ran.returncode == 0, ran.stdout + ran.stderr[-3000:]
    assert "passed: the failure does not reproduce" in ran.stdout
