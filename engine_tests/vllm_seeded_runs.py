"""A bug seeded into vLLM 0.33.0, found from random requests by ``kvfuzz run --scheduler vllm-v1`` and replayed: the
shape the feature files' engine tests share (salts and stop tokens, EOS and min_tokens, LoRA); the steps that run
one request to its end; and the random programs with shared prefixes the model files' engine tests run (chunked
local attention, several groups of one kind, R-SWA)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable, Collection, Sequence

import pytest

from kvfuzz.cli import main
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.trace import SchedulerTrace, load
from kvfuzz.scheduler.violations import Check, SchedulerViolation


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


def shared_prefix_programs(
    setup: SchedulerSetup,
    examples: int,
    prefix: Sequence[int],
    chance: float,
    tail: int,
    outputs: int,
    groups: Callable[[Session], Sequence[int]],
) -> tuple[dict[int, int], int]:
    """``examples`` random programs of 30 operations, each drained: a request added with ``chance`` (a prompt of
    ``prefix``'s first tokens then up to ``tail`` repeats of one token, asking 1 to ``outputs`` tokens), a step
    otherwise. Returns, for each KV-cache group ``groups`` names, the most null entries one request's table held there,
    and the longest prefix-cache hit."""
    nulled: dict[int, int] = {}
    hits = 0
    for example in range(examples):
        rng = random.Random(example)
        session = Session(setup)
        managers = session.scheduler.kv_cache_manager.coordinator.single_type_managers
        for _ in range(30):
            if rng.random() < chance:
                session.add(
                    list(prefix[: rng.randint(1, len(prefix))]) + [rng.randint(0, 3)] * rng.randint(0, tail),
                    rng.randint(1, outputs),
                )
            else:
                session.step()
            for group in groups(session):
                for blocks in managers[group].req_to_blocks.values():
                    nulled[group] = max(nulled.get(group, 0), sum(block.is_null for block in blocks))
            hits = max([hits, *(state.hit for state in session.worker.requests.values())])
        session.drain()
    return nulled, hits


def first_violation(run: Callable[[], object]) -> SchedulerViolation:
    """The violation ``run`` raises (it must raise one)."""
    with pytest.raises(SchedulerViolation) as raised:
        run()
    return raised.value
