"""A scheduler trace's file is read and written by the one trace-file layer every format shares
(kvfuzz/trace_files.py), so it gets what the allocator's traces had and it lacked: hostile bytes refused in one line
naming the file (its reader raised ``RecursionError`` on deep nesting, took NaN and a repeated field, and blocked
forever opening a FIFO), and a FIFO of the trace's name never renamed over. The allocator's side of each case:
tests/test_hostile_traces.py."""

from __future__ import annotations

import codecs
import json
import os
import stat
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
from test_scheduler_traces import TRACE

from kvfuzz.cli import main
from kvfuzz.scheduler.trace import SchedulerTraceError, load, save


def _text() -> str:
    return json.dumps(TRACE.to_json(), indent=2)


HOSTILE: dict[str, tuple[Callable[[Path], Any], str]] = {
    "not UTF-8": (lambda path: path.write_bytes(_text().encode().replace(b'"r0"', b'"r\xff"')), "not UTF-8 text"),
    "UTF-16": (lambda path: path.write_bytes(codecs.BOM_UTF16_LE + _text().encode("utf-16-le")), "UTF-16 text"),
    "deeply nested": (lambda path: path.write_text("[" * 200_000 + "]" * 200_000), "nested too deeply"),
    "over 16 MiB": (lambda path: path.write_text(" " * (16 * 2**20) + _text()), "over 16 MiB"),
    "NaN": (
        lambda path: path.write_text(_text().replace('"num_blocks": 8', '"num_blocks": NaN')),
        "NaN is not a JSON number",
    ),
    "a repeated field": (
        lambda path: path.write_text(_text().replace('"shrunk": true', '"shrunk": true, "shrunk": false')),
        '"shrunk" appears twice',
    ),
    "a directory": (lambda path: path.mkdir(), "not a regular file"),
    "empty": (lambda path: path.write_bytes(b""), "empty"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_load_refuses_hostile_bytes_in_one_line_naming_the_file(tmp_path: Path, case: str) -> None:
    make, expected = HOSTILE[case]
    path = tmp_path / "hostile.json"
    make(path)
    with pytest.raises(SchedulerTraceError) as caught:
        load(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and expected in message and "\n" not in message, message


def test_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    """Before, ``open`` of a FIFO blocked until a writer came: ``kvfuzz replay`` of a corpus holding one hung."""
    path = tmp_path / "planted.json"
    os.mkfifo(path)
    outcome: list[BaseException] = []
    reader = threading.Thread(target=lambda: _load_into(path, outcome), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "load blocked on a FIFO"
    assert len(outcome) == 1 and isinstance(outcome[0], SchedulerTraceError), outcome
    assert "not a regular file" in str(outcome[0])


def _load_into(path: Path, outcome: list[BaseException]) -> None:
    try:
        load(path)
    except BaseException as error:  # noqa: BLE001 -- the test reads what it was
        outcome.append(error)


def test_a_fifo_of_the_traces_name_is_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / TRACE.file_name()
    os.mkfifo(path)
    with pytest.raises(OSError, match="not a regular file, which kvfuzz will not replace"):
        save(TRACE, tmp_path)
    assert stat.S_ISFIFO(os.lstat(path).st_mode) and [entry.name for entry in tmp_path.iterdir()] == [path.name]


def test_a_damaged_file_of_the_traces_name_is_replaced_and_a_same_one_kept(tmp_path: Path) -> None:
    path = tmp_path / TRACE.file_name()
    path.write_text(_text()[:40])
    assert save(TRACE, tmp_path) == (path, True) and load(path) == TRACE
    before = path.stat().st_mtime_ns
    assert save(TRACE, tmp_path) == (path, False) and path.stat().st_mtime_ns == before


def test_replay_reports_a_deeply_nested_scheduler_trace_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command's side: before, ``RecursionError`` escaped ``kvfuzz replay`` as a traceback."""
    path = tmp_path / "deep.json"
    path.write_text('{"format": "kvfuzz-scheduler-trace/1", "x": ' + "[" * 200_000 + "]" * 200_000 + "}")
    assert main(["replay", str(path)]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "nested too deeply" in captured.out + captured.err
