"""A bug seeded into vLLM 0.33.0, found from random requests by ``kvfuzz run --scheduler vllm-v1`` and replayed: the
shape the feature files' engine tests share (salts and stop tokens, EOS and min_tokens, LoRA); and the steps that run
one request to its end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Collection, Sequence

import pytest

from kvfuzz.cli import main
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.trace import SchedulerTrace, load
from kvfuzz.scheduler.violations import Check


def found_and_replayed(
    capsys: pytest.CaptureFixture[str], corpus: Path, options: Sequence[str], checks: Collection[Check], named: str
) -> SchedulerTrace:
    """``kvfuzz run --scheduler vllm-v1 --num-blocks 8 OPTIONS --examples 50``, the bug seeded: the run fails one of
    ``checks``, its explanation says ``named``, and the trace it saved replays the same failure word for word
    (returned, for what the caller asserts of it)."""
    run = ["run", "--scheduler", "vllm-v1", "--num-blocks", "8", *options]
    assert main([*run, "--examples", "50", "--corpus", str(corpus), "--json"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["check"] in {check.value for check in checks}, summary
    assert named in summary["explanation"], summary["explanation"]  # the message says why
    trace = load(Path(summary["trace"]))
    replayed = replay(trace)
    assert replayed.reproduced and replayed.identical, replayed.describe_failure()
    return trace


def run_until_finished(session: Session, request: str) -> None:
    """Steps until ``request`` has finished (every check runs at each)."""
    while request in session.outputs.unfinished():
        session.step()
