"""``kvfuzz show`` of an SGLang scheduler trace: the replay drawn as a timeline of requests over SGLang's steps
(docs/timeline.md). The corpus's page-overhead hang: its one request waits, holding nothing, at the step the check
fails; and a program of three requests through a small pool, which passes: each waits, runs holding pages, and
finishes holding none.

Runs in SGLang's environment (``scripts/third_party_env.sh sglang``; CI runs it there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfuzz.cli import main
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.program import AddRequest, Step
from kvfuzz.scheduler.trace import RecordedFailure, SchedulerTrace
from kvfuzz.scheduler.violations import Check, SchedulerViolation
from kvfuzz.timeline.requests import record_requests

CORPUS = Path(__file__).resolve().parent.parent / "corpus"
PAGE_OVERHEAD = CORPUS / "sglang-scheduler-page-overhead-hang-935382078725.json"


def test_the_hang_s_request_waits_holding_nothing_at_the_failing_step(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    page = tmp_path / "page.html"
    assert main(["show", str(PAGE_OVERHEAD), "--html", str(page)]) == 0
    assert "replayed: reproduced at step 1, request r0 (1 steps)" in capsys.readouterr().out
    text = page.read_text(encoding="utf-8")
    assert 'id="failing-column"' in text and 'id="lane-r0"' in text
    assert "step 1: waiting (waiting queue); 0 tokens scheduled, 0 computed; blocks held: none" in text


def test_requests_wait_run_holding_pages_and_finish_holding_none() -> None:
    program = [AddRequest([0, 1, 2, 3, 4], 3), AddRequest([5, 6, 7], 3), Step(), AddRequest([8, 9], 2), Step()]
    # a trace whose recorded failure is a placeholder: the replay passes, and the timeline says so
    trace = SchedulerTrace(
        scheduler="sglang",
        setup=SchedulerSetup(num_blocks=6, block_size=4, prefix_caching=False),
        model_runner="",
        vllm_version="0.5.23",
        program=program,
        failure=RecordedFailure.of(SchedulerViolation(Check.PROGRESS, 1, "r0", "placeholder")),
        shrunk=True,
    )
    timeline = record_requests(trace, "constructed")
    assert timeline.verdict == "passed" and timeline.failing_step is None and timeline.failure == ""
    assert timeline.requests == ("r0", "r1", "r2")
    lanes = dict(zip(timeline.requests, timeline.cells))
    for request, lane in lanes.items():
        states = [cell.state for cell in lane if cell is not None]
        assert "running" in states and states[-1] == "finished", (request, states)
        running = [cell for cell in lane if cell is not None and cell.state == "running"]
        assert all(cell.blocks and 0 not in cell.blocks and cell.scheduled > 0 for cell in running), request
        assert lane[-1] is not None and lane[-1].blocks == ()
    first = lanes["r0"][0]
    assert first is not None and (first.state, first.scheduled) == ("running", 5) and len(first.blocks) == 2
    assert lanes["r2"][0] is None and lanes["r2"][1] is not None  # added after the first step
