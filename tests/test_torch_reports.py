"""``kvfuzz report`` of torch's PagedAttention trace (``PagedAttention.erase`` leaves ``physical_to_logical``
behind): the standalone reproducer runs with torch alone, kvfuzz not importable (engine_tests/standalone.py), and
fails with the attention Failure naming the sequence that attends the erased pages."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_tests.standalone import check_allocator_failure, real_bugs, report, run_without_kvfuzz


def test_the_paged_attention_bug_is_the_one_findings_lists() -> None:
    assert real_bugs("paged-attention-*.json") == ["paged-attention-attention-740b2f034fe4.json"]


@pytest.mark.slow
def test_the_reproducer_of_the_paged_attention_bug_fails_without_kvfuzz(tmp_path: Path) -> None:
    name = "paged-attention-attention-740b2f034fe4.json"
    ran = run_without_kvfuzz(report(name, tmp_path))
    check_allocator_failure(name, ran)
    assert "physical_to_logical" in ran.stderr.splitlines()[-1]
