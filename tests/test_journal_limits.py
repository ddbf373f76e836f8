"""A journal's size is bounded (issue 45, item 8: a 316 MB journal took 1.2 GB to recover): a run starts its journal
afresh once it passes ``JOURNAL_LIMIT`` (only its last program is ever recovered), and recovery reads a journal line
by line, a large one only from its first line and its tail, never whole."""

from __future__ import annotations

import json
import os
import stat
import threading
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
    journal = Journal(tmp_path, {"allocator": "kvfuzz"}, {"config": config_json(config, config.inflight_window)})
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


def test_recovery_reads_no_more_than_a_header_s_worth_of_a_huge_first_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a large journal's first line was read whole, however long (a journal of one 316 MB line took it all)."""
    monkeypatch.setattr(journals, "MAX_READ", 50_000)
    path = tmp_path / f"{safeguards.JOURNAL_PREFIX}999999999.jsonl"
    path.write_bytes(b"x" * 2_000_000 + b"\n" + b"[" * 40_000 + b"\n" + b"y" * 100 + b"\n")
    read = list(journals._journal_lines(path))
    assert sum(map(len, read)) < 50_000 + 64 * 1024  # the tail, and no more of the first line than a header takes
    assert read[-1] == b"y" * 100 + b"\n"
    # a line nested too deeply for Python's parser is no record, as any other that is not JSON: no header, nothing ran
    assert journals.recover(tmp_path) == [] and not path.exists()


def _planted_journal(tmp_path: Path) -> tuple[Path, Path]:
    """A valid journal of a dead process, outside the corpus, and the name a journal of that pid has in the corpus."""
    config = MachineConfig()
    header = {"format": "kvfuzz-journal/1", "pid": 999_999_999, "allocator": "kvfuzz", "config": config_json(config, 0)}
    admit = {"seq": "s0", "namespace": [], "system": [], "suffix": [1]}
    elsewhere = tmp_path / "elsewhere.jsonl"
    lines = [header, {"example": 1}, {"rule": "admit", "arguments": admit}]
    elsewhere.write_text("".join(json.dumps(line) + "\n" for line in lines))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    return elsewhere, corpus / f"{safeguards.JOURNAL_PREFIX}999999999.jsonl"


def test_recovery_leaves_a_journal_that_is_a_link_or_a_fifo_alone_in_one_line(tmp_path: Path) -> None:
    """Before: a journal name in a shared corpus that was a symbolic link had its target read (a link to /dev/zero
    is read without end) and made a trace, and a FIFO hung recovery, and with it every command that saves traces."""
    elsewhere, name = _planted_journal(tmp_path)
    name.symlink_to(elsewhere)
    (linked,) = journals.recover(name.parent)
    assert linked.trace is None and "is a symbolic link, not a journal: left alone" in linked.message
    assert name.is_symlink() and not list(name.parent.glob("*.json"))
    name.unlink()
    os.mkfifo(name)
    outcome: list[list[journals.Recovered]] = []
    recovering = threading.Thread(target=lambda: outcome.append(journals.recover(name.parent)), daemon=True)
    recovering.start()
    recovering.join(timeout=20)
    if recovering.is_alive():  # blocked opening the FIFO: a writer lets it go on, and the test fail
        os.close(os.open(name, os.O_WRONLY | os.O_NONBLOCK))
        recovering.join(timeout=20)
        pytest.fail("recovery waited on a FIFO named like a journal")
    ((fifo,),) = outcome
    assert fifo.trace is None and "is not a regular file, not a journal: left alone" in fifo.message
    assert stat.S_ISFIFO(os.lstat(name).st_mode) and not list(name.parent.glob("*.json"))


def test_a_journal_is_never_written_through_a_link_planted_under_its_name(tmp_path: Path) -> None:
    """Before: the journal was opened with ``open(path, "w")``, so a link in the corpus named like this process's
    journal had its target truncated and overwritten with the programs."""
    victim = tmp_path / "precious.txt"
    victim.write_text("the only copy\n")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    safeguards.journal_path(corpus).symlink_to(victim)
    config = MachineConfig()
    journal = Journal(corpus, {"allocator": "kvfuzz"}, {"config": config_json(config, config.inflight_window)})
    journal.begin_example()
    journal.call(CALL)
    assert victim.read_text() == "the only copy\n"
    assert not journal.path.is_symlink() and json.loads(journal.path.read_text().splitlines()[-1]) == CALL
    journal.close()
