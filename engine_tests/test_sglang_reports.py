"""``kvfuzz report`` of every SGLang trace in corpus/ that shows a real SGLang bug: the standalone reproducer it writes
runs in SGLang's environment with kvfuzz not importable (engine_tests/standalone.py) and fails with the recorded
check: the radix cache's traces (kvfuzz.adapters.sglang:radix_cache_lora, the lora_id/extra_key collision) with the
reproducer's cache-soundness or content Failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_tests.standalone import check_allocator_failure, real_bugs, report, run_without_kvfuzz

RADIX_CACHE_BUGS = real_bugs("sglang-radix-cache-*.json")


def test_the_radix_cache_bugs_are_the_three_findings_lists() -> None:
    assert RADIX_CACHE_BUGS == [
        "sglang-radix-cache-lora-cache-soundness-d851dea53690.json",
        "sglang-radix-cache-lora-content-417691461a2b.json",
        "sglang-radix-cache-lora-readmit-d51fce9c8732.json",
    ]


@pytest.mark.parametrize("name", RADIX_CACHE_BUGS)
def test_the_reproducer_of_a_radix_cache_bug_fails_without_kvfuzz(name: str, tmp_path: Path) -> None:
    check_allocator_failure(name, run_without_kvfuzz(report(name, tmp_path)))
