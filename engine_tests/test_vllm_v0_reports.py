"""``kvfuzz report`` of every vLLM v0 block-manager trace in corpus/ (kvfuzz.adapters.vllm_v0, vLLM 0.10.2), each a real
vLLM bug: the standalone reproducer it writes runs in the vllm-v0 environment with kvfuzz not importable
(engine_tests/standalone.py) and fails as recorded: vLLM's own exception for a crash (AssertionError, IndexError,
KeyError, raised in the function the recorded traceback ends in), else the reproducer's cache-soundness Failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_tests.standalone import check_allocator_failure, real_bugs, report, run_without_kvfuzz

V0_BUGS = real_bugs("vllm-v0-*.json")


def test_the_v0_bugs_are_the_twelve_findings_lists() -> None:
    assert len(V0_BUGS) == 12 and all(name.startswith("vllm-v0-") for name in V0_BUGS)


@pytest.mark.parametrize("name", V0_BUGS)
def test_the_reproducer_of_a_v0_bug_fails_without_kvfuzz(name: str, tmp_path: Path) -> None:
    check_allocator_failure(name, run_without_kvfuzz(report(name, tmp_path)))
