"""The envelope every trace format shares (kvfuzz/trace_format.py): each case below is played on an allocator trace
and on a scheduler trace, and both formats must answer it in the same words, since one reader checks both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from kvfuzz.saved import trace as allocator_trace
from kvfuzz.scheduler import trace as scheduler_trace
from kvfuzz.trace_files import TraceFileError

ROOT = Path(__file__).resolve().parent.parent
FILES = {
    "kvfuzz-trace": ROOT / "corpus" / "nocopyonwrite-exclusive-writes-b4ceae19c430.json",
    "kvfuzz-scheduler-trace": ROOT / "corpus" / "vllm-v1-scheduler-full-reports-partial-hit-crash-ed954bdbb683.json",
}
KINDS = {"kvfuzz-trace": "kvfuzz trace", "kvfuzz-scheduler-trace": "scheduler trace"}
LOADERS: dict[str, Callable[[Path], Any]] = {
    "kvfuzz-trace": allocator_trace.load,
    "kvfuzz-scheduler-trace": scheduler_trace.load,
}
OTHER = {"kvfuzz-trace": "kvfuzz-scheduler-trace/1", "kvfuzz-scheduler-trace": "kvfuzz-trace/1"}
FORMATS = list(FILES)


def refusal(tmp_path: Path, name: str, data: Any) -> str:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TraceFileError) as caught:
        LOADERS[name](path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    return message[len(f"{path}: ") :]


def edited(name: str, change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    data = json.loads(FILES[name].read_text())
    change(data)
    return data


@pytest.mark.parametrize("name", FORMATS)
def test_a_newer_version_of_the_format_is_named_as_such(tmp_path: Path, name: str) -> None:
    line = refusal(tmp_path, name, edited(name, lambda d: d.update(format=f"{name}/2")))
    assert line == f"written by a newer kvfuzz (format {name}/2); this kvfuzz reads {name}/1"


@pytest.mark.parametrize("name", FORMATS)
def test_another_format_or_none_is_not_this_kind_of_trace(tmp_path: Path, name: str) -> None:
    other = refusal(tmp_path, name, edited(name, lambda d: d.update(format=OTHER[name])))
    assert other == f'not a {KINDS[name]} ("format" is "{OTHER[name]}"; expected "format": "{name}/1")'
    missing = refusal(tmp_path, name, edited(name, lambda d: d.pop("format")))
    assert missing == f'not a {KINDS[name]} (no format field; expected "format": "{name}/1")'
    listed = refusal(tmp_path, name, [1, 2])
    assert listed == f"not a {KINDS[name]}: the file holds a JSON list, not a JSON object"


@pytest.mark.parametrize("name", FORMATS)
def test_the_common_fields_are_checked_alike(tmp_path: Path, name: str) -> None:
    both = refusal(tmp_path, name, edited(name, lambda d: d.update(known_bug="unfixed", fixed="abc123")))
    assert both == "fixed: a trace of a fixed bug cannot be a known (unfixed) bug too: clear known_bug"
    control = refusal(tmp_path, name, edited(name, lambda d: d.update(kvfuzz_version="0.1\x1b[2J")))
    assert control.startswith("kvfuzz_version: ") and control.endswith("holds control characters")
    assert refusal(tmp_path, name, edited(name, lambda d: d.pop("program"))) == "program: missing"
    assert refusal(tmp_path, name, edited(name, lambda d: d.pop("failure"))) == "failure: missing"
    assert refusal(tmp_path, name, edited(name, lambda d: d.update(known_bug=3))).startswith("known_bug: must be")


@pytest.mark.parametrize("name", FORMATS)
def test_a_trace_without_its_kvfuzz_version_loads_as_unknown(tmp_path: Path, name: str) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps(edited(name, lambda d: d.pop("kvfuzz_version"))))
    assert LOADERS[name](path).kvfuzz_version == "unknown"


def test_a_shared_finding_of_a_newer_scheduler_format_is_told_apart_by_its_name() -> None:
    """Redis records carry a trace as JSON: a scheduler trace of a newer version is still a scheduler trace (refused
    as newer), never read as an allocator trace of another format."""
    names = scheduler_trace.SCHEDULER_TRACE_FORMAT.names
    assert names({"format": "kvfuzz-scheduler-trace/7"}) and names({"format": "kvfuzz-scheduler-trace/1"})
    assert not names({"format": "kvfuzz-trace/1"}) and not names({"format": 3}) and not names([1])
    assert allocator_trace.TRACE_FORMAT.names({"format": "kvfuzz-trace/2"})


def test_the_digest_of_every_corpus_trace_is_the_one_its_file_name_was_given() -> None:
    """The digest identifies a failure in file names, Redis keys and dedup: moving it into the envelope must not
    change it. The corpus files' names were written by kvfuzz from the digest at the time (a few were renamed by
    hand, without one), except two whose configuration an early change of the contract edited in place."""
    edited_in_place = {
        "vllm-v0-release-before-compute-9c57545e0b54",
        "vllm-v1-kv-cache-manager-cache-soundness-382d392d8a83",
    }
    checked, differing = 0, set()
    for path in sorted((ROOT / "corpus").glob("*.json")):
        data = json.loads(path.read_text())
        loader = scheduler_trace if data["format"] == "kvfuzz-scheduler-trace/1" else allocator_trace
        trace = loader.load(path)
        name = path.stem
        if len(name) > 13 and name[-13] == "-" and all(c in "0123456789abcdef" for c in name[-12:]):
            checked += 1
            if trace.digest() != name[-12:]:
                differing.add(name)
    assert differing == edited_in_place and checked >= 30
