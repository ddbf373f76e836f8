"""``kvfuzz report`` of every vLLM v1 trace in corpus/ that shows a real vLLM bug (scheduler target, and the KV-cache
manager adapter's): the standalone reproducer it writes runs in vLLM's environment with kvfuzz not importable
(engine_tests/standalone.py) and fails with the recorded check. For the traces of bugs vLLM already fixed
(``issue-*``, ``pull-*``), the reproducer passes on the installed vLLM (the fix applied) and fails with the bug put
back (engine_tests/vllm_history.py's seeded patch, applied in the reproducer's process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_tests.standalone import CORPUS, check_allocator_failure, real_bugs, report, run_without_kvfuzz
from kvfuzz.cli import main

REAL_BUGS = real_bugs("vllm-v1-scheduler-*.json")

KV_CACHE_MANAGER_BUGS = real_bugs("vllm-v1-kv-cache-manager-*.json")
"""The allocator-target traces of vLLM v1's KVCacheManager (kvfuzz.adapters.vllm_v1), every one a real vLLM bug."""

SEEDED = {
    "vllm-v1-scheduler-issue-11562-touch-first-3e993e943ea3.json": "touch_before_the_capacity_check",
    "vllm-v1-scheduler-pull-11565-evictable-hits-61fdff1af58a.json": "capacity_check_ignores_evictable_hits",
    "vllm-v1-scheduler-issue-23347-victim-stays-scheduled-02ea5ce953c3.json": "priority_victim_stays_scheduled",
    "vllm-v1-scheduler-issue-23316-victim-keeps-tokens-02ea5ce953c3.json": "priority_victim_keeps_its_tokens",
}
"""The fixed bugs' traces, and the patch of engine_tests/vllm_history.py that puts each bug back."""


def recorded_failure(name: str) -> tuple[str, str]:
    """The reproducer's words for the trace's recorded check, and the request (or step) it names."""
    failure = json.loads((CORPUS / name).read_text())["failure"]
    if failure["check"] == "crash":  # vLLM's own exception, its traceback's last line
        return failure["exception"], ""
    if failure["check"] == "progress":
        return "Failure: progress:", f"{failure['request']} ("
    if failure["check"] == "content":  # R-SWA: a position the runner attends mapped to the null block
        return "Failure: content at step", f"step {failure['step']}: {failure['request']}'s position"
    return "Failure: accounting at step", f"step {failure['step']}:"


def test_the_real_bugs_are_the_ones_the_issue_names() -> None:
    assert REAL_BUGS == [
        "vllm-v1-scheduler-full-reports-partial-hit-crash-ed954bdbb683.json",  # the Mamba hybrid, full event reports
        "vllm-v1-scheduler-long-prefill-padding-assertion-03e33c236fbe.json",  # found through the long-prefill row
        "vllm-v1-scheduler-mamba-partial-hit-admission-hang-d591b6629908.json",  # the Mamba hybrid, partial hits
        "vllm-v1-scheduler-mamba-session-resume-gate-hang-ad7ef67d44b6.json",  # the Mamba hybrid, a session's turns
        "vllm-v1-scheduler-offloading-load-gate-hang-99d75d3823f8.json",
        "vllm-v1-scheduler-offloading-load-gate-hang-v2-c7697394cd8d.json",  # the same program under V2's protocol
        "vllm-v1-scheduler-offloading-one-token-reload-hang-29b8f30c1dd1.json",
        "vllm-v1-scheduler-offloading-shared-block-ref-cnt-b481f5a07fcd.json",  # the waiting-queue bug, ref_cnt
        "vllm-v1-scheduler-offloading-waiting-queue-holds-blocks-a8dffbbfe266.json",
        "vllm-v1-scheduler-rswa-session-gap-a102da1e3f89.json",  # R-SWA, a streaming session's next turn
        "vllm-v1-scheduler-session-blocks-reset-error-c18d23100ce4.json",  # a streaming session, a prefix-cache reset
        "vllm-v1-scheduler-sessions-holding-pool-deadlock-68ba1f36c223.json",  # streaming sessions' later turns
        "vllm-v1-scheduler-speculative-padding-hang-6123748f32e9.json",
    ]


@pytest.mark.parametrize("name", REAL_BUGS)
def test_the_reproducer_of_a_real_bug_fails_without_kvfuzz(name: str, tmp_path: Path) -> None:
    ran = run_without_kvfuzz(report(name, tmp_path))
    check, where = recorded_failure(name)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    last = ran.stderr.strip().splitlines()[-1]
    assert last.startswith(check) and where in last, ran.stderr[-3000:]
    assert "kvfuzz is importable" not in ran.stderr


CONTROLS = {
    "vllm-v1-scheduler-full-reports-partial-hit-crash-ed954bdbb683.json": {"kv_events_full": False},
    "vllm-v1-scheduler-mamba-partial-hit-admission-hang-d591b6629908.json": {"prefix_match_unit": 0},
    "vllm-v1-scheduler-session-blocks-reset-error-c18d23100ce4.json": {"program": -1},
}
"""The bugs whose reproducer builds what the first reproducers did not (the Mamba hybrid, partial hits, KV cache
events, a streaming session, a prefix-cache reset), and what takes the trigger away: a setting, or the program's
last operation (the reset)."""


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_the_reproducer_passes_where_the_trigger_is_taken_away(name: str, tmp_path: Path) -> None:
    """The reproducer's engine plays the rest as the target does: the same program passes without the setting that
    triggers the bug (or without the reset), so the failure is the bug's, not the reproducer's (a Mamba hybrid it
    built wrong would hang here too; a session it never closed would leave its request unfinished)."""
    trace = json.loads((CORPUS / name).read_text())
    control = CONTROLS[name]
    if "program" in control:
        trace["program"] = trace["program"][: control["program"]]
    else:
        trace["config"] |= control
    source = tmp_path / name
    source.write_text(json.dumps(trace))
    output = tmp_path / "report.md"
    assert main(["report", str(source), "-o", str(output)]) == 0
    ran = run_without_kvfuzz(tmp_path / "report_reproducer.py")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "passed: the failure does not reproduce" in ran.stdout


@pytest.mark.parametrize("name", sorted(SEEDED))
def test_the_reproducer_of_a_fixed_bug_passes_with_the_fix_and_fails_with_the_bug(name: str, tmp_path: Path) -> None:
    reproducer = report(name, tmp_path)
    fixed = run_without_kvfuzz(reproducer)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert "passed: the failure does not reproduce" in fixed.stdout
    broken = run_without_kvfuzz(reproducer, SEEDED[name])
    assert broken.returncode == 1, broken.stdout + broken.stderr
    last = broken.stderr.strip().splitlines()[-1]
    failure = json.loads((CORPUS / name).read_text())["failure"]
    expected = (
        f"Failure: {failure['check']} at step {failure['step']}:" if failure["check"] in ("accounting", "batch") else ""
    )
    assert last.startswith(expected or failure["exception"] or "?"), broken.stderr[-3000:]


def test_kvfuzz_is_refused_by_the_wrapper(tmp_path: Path) -> None:
    """The hook is what keeps kvfuzz out: a 'reproducer' that imports kvfuzz fails on that import."""
    cheat = tmp_path / "cheat.py"
    cheat.write_text("import kvfuzz.scheduler\n")
    ran = run_without_kvfuzz(cheat)
    assert ran.returncode == 1 and "ImportError: kvfuzz is not importable here" in ran.stderr, ran.stderr


def test_the_kv_cache_manager_bugs_are_the_four_findings_lists() -> None:
    assert KV_CACHE_MANAGER_BUGS == [
        "vllm-v1-kv-cache-manager-cache-soundness-382d392d8a83.json",
        "vllm-v1-kv-cache-manager-kv-connector-eviction-order-25b19409aa87.json",
        "vllm-v1-kv-cache-manager-priority-withdrawn-admit-a0677bc39abc.json",
        "vllm-v1-kv-cache-manager-priority-withdrawn-preempt-35125447fe57.json",
    ]


@pytest.mark.parametrize("name", KV_CACHE_MANAGER_BUGS)
def test_the_reproducer_of_a_kv_cache_manager_bug_fails_without_kvfuzz(name: str, tmp_path: Path) -> None:
    check_allocator_failure(name, run_without_kvfuzz(report(name, tmp_path)))
