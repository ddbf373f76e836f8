"""A failure kvfuzz found is never lost, and a trace file is never trusted (issue 14, items 2, 9 and 10).

* Saving: a trace is written atomically; a corpus that cannot be written still shows the whole trace, and an empty
  or damaged file of the trace's name is replaced instead of being taken for the saved trace.
* Loading: ``kvfuzz.trace.load`` refuses what replay, export or the plugin could not handle safely (a pool that does
  not fit in memory, an operation that does not exist, a file that is not UTF-8 JSON...) with one line naming the
  file and the field; ``kvfuzz replay`` goes on to the next file and ``kvfuzz export`` writes nothing.
* Collection: every trace file is collected whatever its layout, and each bad one is one failing item.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvfuzz.trace import FORMAT, load, save

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
KNOWN_BUG = ROOT / "corpus" / "nocopyonwrite-exclusive-writes-b4ceae19c430.json"  # a zoo slip that reproduces


def kvfuzz(*args: str, cwd: Path, **kwargs: Any) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "kvfuzz.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        **kwargs,
    )


def trace_data() -> dict[str, Any]:
    return json.loads(KNOWN_BUG.read_text())


def write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, indent=2))
    return path


def unwritable_corpus(tmp_path: Path) -> Path:
    """A corpus directory that cannot be created, even by root: its parent is a regular file."""
    (tmp_path / "not-a-directory").write_text("")
    return tmp_path / "not-a-directory" / "corpus"


def trace_json_in(text: str) -> dict[str, Any]:
    """The trace object printed in ``text``: from the line that opens it to the line that closes it."""
    lines = text.splitlines()
    start = lines.index("{")
    end = lines.index("}", start)
    return json.loads("\n".join(lines[start : end + 1]))


# -- item 2: a corpus that cannot be written loses nothing ----------------------------------------------------------


def test_run_prints_the_failure_and_the_whole_trace_when_the_corpus_cannot_be_written(tmp_path: Path) -> None:
    """Old code: the mkdir's OSError escaped as a traceback, and the failure was never printed."""
    corpus = unwritable_corpus(tmp_path)
    result = kvfuzz(
        "run", "--allocator", "zoo:NoCopyOnWrite", "--examples", "300", "--corpus", str(corpus), cwd=tmp_path
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    out = result.stdout
    # The program and explanation come first, then the one line that says the trace was not saved, then the trace.
    assert out.index("shrunk program") < out.index("invariant 5 (exclusive writes) violated") < out.index("NOT saved")
    [message] = [line for line in out.splitlines() if "NOT saved" in line]
    assert str(corpus) in message and "kvfuzz replay" in message
    printed = trace_json_in(out)
    assert printed["format"] == FORMAT and printed["allocator"] == "zoo:NoCopyOnWrite"
    assert load(write(tmp_path / "recovered.json", printed)).failure["invariant"] == 5


def test_run_json_keeps_one_object_and_carries_the_unsaved_trace(tmp_path: Path) -> None:
    """Old code: a traceback on stderr and nothing at all on stdout."""
    corpus = unwritable_corpus(tmp_path)
    result = kvfuzz(
        "run", "--allocator", "zoo:NoCopyOnWrite", "--examples", "300", "--corpus", str(corpus), "--json", cwd=tmp_path
    )
    assert result.returncode == 1, result.stderr
    summary = json.loads(result.stdout)  # one JSON object, nothing else
    assert summary["failed"] and summary["trace"] is None
    assert str(corpus) in summary["trace_error"]
    assert load(write(tmp_path / "recovered.json", summary["unsaved_trace"])).allocator == "zoo:NoCopyOnWrite"


def _full_disk() -> None:
    """In the child: any regular file written past 1 KiB fails with EFBIG, as a write to a full disk fails."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))


def test_a_write_that_fails_halfway_leaves_no_partial_trace(tmp_path: Path) -> None:
    """Old code: the write stopped at the limit, left a truncated .json that every later run took for the saved
    trace ("already in the corpus") and that pytest could not load, and the failure was a traceback."""
    result = kvfuzz("run", "--allocator", "zoo:NoCopyOnWrite", "--examples", "300", cwd=tmp_path, preexec_fn=_full_disk)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "NOT saved" in result.stdout and "File too large" in result.stdout
    assert trace_json_in(result.stdout)["allocator"] == "zoo:NoCopyOnWrite"
    assert [path.name for path in (tmp_path / "corpus").iterdir()] == []  # neither a partial trace nor a temporary
    again = kvfuzz("run", "--allocator", "zoo:NoCopyOnWrite", "--examples", "300", cwd=tmp_path)
    assert "trace saved to" in again.stdout and "already in the corpus" not in again.stdout


def test_an_empty_or_damaged_file_of_the_traces_name_is_replaced(tmp_path: Path) -> None:
    """Old code: any existing file of that name counted as the saved trace, a 0-byte one included."""
    trace = load(KNOWN_BUG)
    path = tmp_path / trace.file_name()
    for damaged in ("", '{"format": "kvfuzz-trace/1", "allo'):
        path.write_text(damaged)
        assert save(trace, tmp_path) == (path, True)
        assert load(path).digest() == trace.digest()
    # A valid trace of that name for another failure (hand-edited) is not the same failure either.
    write(path, {**trace_data(), "program": trace_data()["program"][:3]})
    assert save(trace, tmp_path) == (path, True) and load(path).digest() == trace.digest()
    before = path.stat().st_mtime_ns
    assert save(trace, tmp_path) == (path, False) and path.stat().st_mtime_ns == before


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_save_writes_a_temporary_file_syncs_it_and_renames_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """Old code wrote the file in place, neither synced nor renamed: a crash or a full disk midway left a truncated
    trace under the final name."""
    trace = load(KNOWN_BUG)

    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, failing, full)
    with pytest.raises(OSError, match="No space left"):
        save(trace, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_plugin_shows_the_trace_when_it_cannot_save_it(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Old code: the item failed with the OSError's traceback instead of the failure and its trace."""
    corpus = unwritable_corpus(tmp_path)
    result = pytester.runpytest(
        "--kvfuzz-allocator=zoo:LeakyRefusal", "--kvfuzz-examples=200", f"--kvfuzz-corpus={corpus}", "-p",
        "no:cacheprovider",
    )  # fmt: skip
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*invariant 7 (atomic refusal)*", "*shrunk program*", "*trace NOT saved*"])
    assert trace_json_in(str(result.stdout))["allocator"] == "zoo:LeakyRefusal"
