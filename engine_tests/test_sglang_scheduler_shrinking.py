"""Shrinking an SGLang finding by deleting operations (kvfuzz/scheduler/shrinking.py), as a campaign
shrinks a guided campaign's mutant or a failure whose shrinking by Hypothesis drifted: each corpus hang, padded with
operations it does not need (a step before it, steps and a request after), shrinks back to the corpus trace's own
program, every candidate replayed against the installed SGLang.

Runs in the SGLang environment (``scripts/third_party_env.sh sglang``; CI runs it there, on both tested releases)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from kvfuzz.scheduler.program import AddRequest, Step
from kvfuzz.scheduler.replay import bounded_replay
from kvfuzz.scheduler.shrinking import shrink_trace
from kvfuzz.scheduler.signature import scheduler_signature
from kvfuzz.scheduler.trace import load

CORPUS = Path(__file__).parent.parent / "corpus"


@pytest.mark.parametrize("path", sorted(CORPUS.glob("sglang-scheduler-*.json")), ids=lambda path: path.stem)
def test_a_padded_corpus_hang_shrinks_back_to_its_own_program(path: Path) -> None:
    trace = load(path)
    padded = attrs.evolve(trace, program=(Step(), *trace.program, Step(), Step(), AddRequest([1], 1), Step()))
    found = bounded_replay(padded, 60.0)
    assert found.error is not None and found.reproduced, found.describe_failure()
    signature = scheduler_signature(trace.scheduler, found.error)
    shrunk = shrink_trace(padded, signature, lambda candidate: bounded_replay(candidate, 60.0), seconds=60.0)
    assert shrunk.trace.program == trace.program, shrunk.describe(len(padded.program))
    assert shrunk.error is not None and scheduler_signature(trace.scheduler, shrunk.error) == signature
