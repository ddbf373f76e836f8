"""Failures that last: traces saved by a run, replayed without Hypothesis, exported as pytest files, collected by
the pytest plugin, and examples kept in Hypothesis's database."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from factories import kvfuzz
from hypothesis.database import DirectoryBasedExampleDatabase

from kvfuzz.allocator.types import PoolSpec
from kvfuzz.program.call import Call
from kvfuzz.registry import load_factory
from kvfuzz.runner import run
from kvfuzz.saved.corpus import export_test, replay_trace, trace_of
from kvfuzz.saved.trace import Trace, from_json, load, save
from kvfuzz.statemachines import MachineConfig, MisuseCall
from kvfuzz.zoo import ZooAllocator, variant

pytest_plugins = ["pytester"]


@pytest.fixture(scope="module")
def saved_trace(tmp_path_factory) -> Path:
    """The trace `kvfuzz run` leaves for a broken allocator."""
    directory = tmp_path_factory.mktemp("run")
    result = kvfuzz("run", "--allocator", "zoo:NoCopyOnWrite", "--examples", "300", cwd=directory)
    assert result.returncode == 1, result.stdout + result.stderr
    traces = list((directory / ".kvfuzz" / "corpus").glob("*.json"))
    assert len(traces) == 1 and "trace saved to .kvfuzz/corpus/" in result.stdout
    return traces[0]


def test_a_trace_records_allocator_configuration_program_and_failure(saved_trace: Path) -> None:
    data = json.loads(saved_trace.read_text())
    assert data["format"] == "kvfuzz-trace/1" and data["allocator"] == "zoo:NoCopyOnWrite"
    assert data["config"]["block_size"] == 4 and data["config"]["inflight_window"] == 1
    assert data["config"]["dtype"] == "float32" and data["config"]["device"] == "cpu"
    assert data["failure"]["invariant"] == 5 and "exclusive writes" in data["failure"]["explanation"]
    assert [step["rule"] for step in data["program"]][0] == "admit" and data["known_bug"] is None


def test_the_same_failure_is_not_saved_twice(saved_trace: Path) -> None:
    result = kvfuzz("run", "--allocator", "zoo:NoCopyOnWrite", "--examples", "300", cwd=saved_trace.parents[2])
    assert "already in the corpus" in result.stdout
    assert len(list(saved_trace.parent.glob("*.json"))) == 1


def test_replay_fails_while_the_bug_reproduces_and_passes_on_the_correct_allocator(saved_trace: Path) -> None:
    broken = kvfuzz("replay", str(saved_trace), cwd=saved_trace.parent)
    assert broken.returncode == 1
    assert "REPRODUCED at call" in broken.stdout and "invariant 5 (exclusive writes)" in broken.stdout
    assert "    1  state.admit(" in broken.stdout
    fixed = kvfuzz(
        "replay", str(saved_trace), "--allocator", "kvfuzz.allocator.paged:paged_allocator", cwd=saved_trace.parent
    )
    assert fixed.returncode == 0 and "no longer reproduces" in fixed.stdout


@pytest.mark.slow
def test_exported_file_fails_and_passes_the_same_way_under_pytest(saved_trace: Path, tmp_path: Path) -> None:
    for allocator, expected in ((None, 1), ("kvfuzz.allocator.paged:paged_allocator", 0)):
        path = tmp_path / f"test_exported_{expected}.py"
        args = ["export", str(saved_trace), "-o", str(path)] + (["--allocator", allocator] if allocator else [])
        assert kvfuzz(*args, cwd=tmp_path).returncode == 0
        text = path.read_text()
        assert "state.fork(" in text and "state.teardown()" in text
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert result.returncode == expected, result.stdout


def test_trace_round_trip_keeps_tuples_and_misuse_calls(tmp_path: Path) -> None:
    program = [
        Call("admit", {"seq": "s0", "namespace": ("ab", "c"), "system": (0, 3), "suffix": [1]}),
        Call("misuse", {"call": MisuseCall("grow", ("s0", ()), "no tokens")}),
    ]
    trace = Trace("zoo:NoCopyOnWrite", MachineConfig(), program, {"invariant": 5, "title": "exclusive writes"}, 1)
    path, written = save(trace, tmp_path)
    assert written and not save(trace, tmp_path)[1]
    loaded = load(path)
    assert loaded.program == trace.program and loaded.digest() == trace.digest()
    assert loaded.config == attrs.evolve(trace.config, inflight_window=1)  # it asks for the W the file records


def _leak_declaring_window_2(spec: PoolSpec) -> ZooAllocator:
    """LeakOnCancel, declaring W = 2 whatever its pool asks (None: the factory's own)."""
    return variant("LeakOnCancel").factory()(attrs.evolve(spec, inflight_window=2))


def test_the_run_summary_carries_the_declared_window_and_the_trace_takes_it_from_there() -> None:
    """The run asks the factory for no W; the allocator declares 2: the summary says so, and the trace records 2
    (its configuration still asks for none) and, loaded, asks for 2."""
    summary = run(_leak_declaring_window_2, MachineConfig(), examples=20)
    assert summary.failed and summary.declared_window == 2
    trace = trace_of(summary, "tests.test_corpus:_leak_declaring_window_2", MachineConfig())
    assert trace is not None and trace.declared_window == 2 and trace.config.inflight_window is None
    assert trace.to_json()["config"]["inflight_window"] == 2
    assert from_json(trace.to_json()).config.inflight_window == 2


def test_known_bug_traces_replay_through_the_public_api() -> None:
    summary = run(variant("RepeatedBlockAfterRollback").factory(), MachineConfig(), examples=300)
    trace = trace_of(summary, "zoo:RepeatedBlockAfterRollback", MachineConfig())
    assert trace is not None and replay_trace(trace).reproduced
    assert not replay_trace(trace, "kvfuzz.allocator.paged:paged_allocator").failed
    assert "def test_" in export_test(trace, "memory")


def test_failures_go_to_the_example_database_and_are_tried_first(tmp_path: Path) -> None:
    database = DirectoryBasedExampleDatabase(tmp_path / "db")
    factory = variant("NoCopyOnWrite").factory()  # found after a few dozen examples (unshrunk: the test is quick)
    first = run(factory, MachineConfig(), examples=2000, database=database, shrink=False)
    again = run(factory, MachineConfig(), examples=2000, database=database, shrink=False)
    assert first.failed and again.failed
    assert again.first_failure_examples == 1 < first.first_failure_examples


def test_registered_allocator_names_load() -> None:
    allocator = load_factory("kvfuzz-sliding-window")(MachineConfig().pool_spec())
    assert allocator.capabilities.sliding_window == 12


def test_plugin_runs_the_machine_and_saves_failures(pytester: pytest.Pytester) -> None:
    passed = pytester.runpytest("--kvfuzz-allocator=kvfuzz", "--kvfuzz-examples=20", "-p", "no:cacheprovider")
    passed.assert_outcomes(passed=1)
    failed = pytester.runpytest(
        "--kvfuzz-allocator=zoo:LeakyRefusal", "--kvfuzz-examples=200", "-p", "no:cacheprovider"
    )
    failed.assert_outcomes(failed=1)
    failed.stdout.fnmatch_lines(["*invariant 7 (atomic refusal)*", "*shrunk program*", "*trace: corpus/*"])
    assert len(list((pytester.path / "corpus").glob("*.json"))) == 1


def test_plugin_collects_traces_as_regression_tests(pytester: pytest.Pytester, saved_trace: Path) -> None:
    corpus = pytester.mkdir("corpus")
    data = json.loads(saved_trace.read_text())
    (corpus / "open.json").write_text(json.dumps(data))
    (corpus / "known.json").write_text(json.dumps({**data, "known_bug": "deliberate zoo slip"}))
    (corpus / "missing.json").write_text(json.dumps({**data, "allocator": "kvfuzz.adapters.no_such_adapter:factory"}))
    result = pytester.runpytest("corpus", "-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(failed=1, passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*still reproduces*", "*cannot load the trace's allocator*"])
    fixed = pytester.runpytest("corpus", "-p", "no:cacheprovider", "--kvfuzz-replay-allocator=kvfuzz")
    fixed.assert_outcomes(failed=1, passed=2)
    fixed.stdout.fnmatch_lines(["*known bug (deliberate zoo slip) no longer reproduces*"])
