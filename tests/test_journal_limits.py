"""A journal's size is bounded (issue 45, item 8: a 316 MB journal took 1.2 GB to recover): a run starts its journal
afresh once it passes ``JOURNAL_LIMIT`` (only its last program is ever recovered), and recovery reads a journal line
by line, a large one only from its first line and its tail, never whole."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvfuzz.engine.config import MachineConfig, config_json
from kvfuzz.program import safeguards
from kvfuzz.program.safeguards import Journal
from kvfuzz.saved import journals
from kvfuzz.saved.trace import load

CALL = {"rule": "step", "arguments": {}}


def test_a_long_run_s_journal_stays_near_its_limit_and_keeps_its_last_program(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(safeguards, "JOURNAL_LIMIT", 4000)
    config = MachineConfig()
    journal = Journal(tmp_path, "kvfuzz", config_json(config, config.inflight_window))
    sizes = []
    for example in range(300):
        journal.begin_example()
        for _ in range(example % 7 + 1):
            journal.call(CALL)
        sizes.append(journal.path.stat().st_size)
    assert max(sizes) < 4000 + 2000  # the limit, plus the program that passed it
    lines = [json.loads(line) for line in journal.path.read_text().splitlines()]
    assert lines[0]["format"] == "kvfuzz-journal/1" and lines[0]["pid"] == os.getpid()
    last = 299 % 7 + 1
    assert lines[-last - 1 :] == [{"example": 300}] + [CALL] * last  # the last program, whole
    journal.close()


def test_recovery_reads_a_huge_journal_from_its_first_line_and_its_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journals, "MAX_READ", 50_000)
    config = MachineConfig()
    header = {"format": "kvfuzz-journal/1", "pid": 999_999_999, "allocator": "kvfuzz", "config": config_json(config, 0)}
    path = tmp_path / f"{safeguards.JOURNAL_PREFIX}999999999.jsonl"
    with open(path, "w") as stream:
        stream.write(json.dumps(header) + "\n")
        stream.write("x" * 2_000_000 + "\n")  # a line far larger than what recovery reads
        stream.write(json.dumps({"example": 1}) + "\n")
        admit = {"seq": "s0", "namespace": [], "system": [], "suffix": [1]}
        stream.write(json.dumps({"rule": "admit", "arguments": admit}) + "\n")
    read = list(journals._journal_lines(path))
    assert sum(map(len, read)) < 50_000 + 1_000  # the first line and the tail: the huge line is never read
    (recovered,) = journals.recover(tmp_path)
    assert recovered.trace is not None and not path.exists()
    trace = load(recovered.trace)
    assert [call.rule for call in trace.program] == ["admit"]
