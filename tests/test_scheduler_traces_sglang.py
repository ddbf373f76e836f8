"""SGLang scheduler traces (scheduler ``sglang``) without SGLang: the format (SGLang's version in ``engine``, no
model runner), the corpus's known-bug trace, ``kvfuzz show`` / ``export``, and the refusal to replay where SGLang is
not installed. The replay itself is tested in SGLang's environment (engine_tests/test_sglang_scheduler_traces.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import attrs
import pytest

from kvfuzz.cli import main
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.program import AddRequest, Step
from kvfuzz.scheduler.trace import RecordedFailure, SchedulerTrace, SchedulerTraceError, from_json, load, save
from kvfuzz.scheduler.violations import Check, SchedulerViolation

CORPUS = Path(__file__).resolve().parent.parent / "corpus"
KNOWN = CORPUS / "sglang-scheduler-ignore-eos-clip-hang-47fe19becd38.json"

TRACE = SchedulerTrace(
    scheduler="sglang",
    setup=SchedulerSetup(num_blocks=6, prefix_caching=False),
    model_runner="",
    vllm_version="0.5.23",
    program=[AddRequest([0, 1, 2], 4), Step()],
    failure=RecordedFailure.of(SchedulerViolation(Check.PROGRESS, 1, "r0", "the step scheduled nothing")),
    shrunk=True,
)


def test_an_sglang_trace_names_sglang_s_version_and_no_model_runner() -> None:
    data = TRACE.to_json()
    assert data["scheduler"] == "sglang" and data["engine"] == {"sglang_version": "0.5.23"}
    assert data["format"] == "kvfuzz-scheduler-trace/1"
    loaded = from_json(data)
    assert loaded == TRACE and loaded.digest() == TRACE.digest()
    assert TRACE.file_name() == f"sglang-progress-{TRACE.digest()}.json"
    assert TRACE.describe()[0] == "scheduler trace (kvfuzz-scheduler-trace/1) of sglang, SGLang 0.5.23"


@pytest.mark.parametrize(
    "engine, line",
    [
        (
            {"vllm_version": "0.33.0", "model_runner": "V1"},
            "trace: engine.vllm_version: unknown field (a trace's engine has only: sglang_version)",
        ),
        ({}, "trace: engine.sglang_version: missing"),
        ({"sglang_version": 5}, "trace: engine.sglang_version: must be a string, not 5"),
    ],
)
def test_an_sglang_trace_with_vllm_s_engine_fields_is_refused_in_one_line(engine: dict, line: str) -> None:
    data = TRACE.to_json()
    data["engine"] = engine
    with pytest.raises(SchedulerTraceError) as caught:
        from_json(data)
    assert str(caught.value) == line


def test_the_digest_tells_sglang_from_vllm() -> None:
    vllm = attrs.evolve(TRACE, scheduler="vllm-v1", model_runner="V1", vllm_version="0.33.0")
    assert vllm.digest() != TRACE.digest()
    assert vllm.to_json()["engine"] == {"vllm_version": "0.33.0", "model_runner": "V1"}


def test_the_corpus_ignore_eos_trace_is_a_known_sglang_bug() -> None:
    trace = load(KNOWN)
    assert trace.scheduler == "sglang" and trace.known_bug and "add_one_req_ignore_eos" in trace.known_bug
    assert trace.setup.prefix_caching is False
    assert trace.program == (AddRequest([0, 1, 2, 0, 1, 2, 0, 1, 0], 7),)
    assert trace.failure.check == "progress" and "r0 (waiting, 0 of 7 output tokens)" in trace.failure.message
    assert KNOWN.name.endswith(f"-{trace.digest()}.json")


def test_show_and_export_of_an_sglang_trace_need_no_sglang(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = save(TRACE, tmp_path)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:5] == [
        "scheduler trace (kvfuzz-scheduler-trace/1) of sglang, SGLang 0.5.23",
        "  6 blocks x 4 slots, token budget 16, at most 4 running, prefix caching off",
        "  shrunk: 2 operation(s), then the drain",
        "    1  add(prompt=[0, 1, 2], max_tokens=4)",
        "    2  step()",
    ]
    exported = tmp_path / "test_exported.py"
    assert main(["export", str(path), "-o", str(exported)]) == 0
    text = exported.read_text()
    compile(text, str(exported), "exec")
    assert "(SGLang 0.5.23)" in text and "session = SGLangSession(setup)" in text
    assert "    session.add([0, 1, 2], 4)\n    session.step()\n    session.drain()" in text
    assert "num_blocks=6" in text and "prefix_caching=False" in text and "model_runner" not in text


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_replay_without_sglang_skips_the_trace_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(KNOWN)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{KNOWN}: skipped: a sglang trace needs sglang 0.5.23, which is not installed here; build its environment "
        "with scripts/third_party_env.sh sglang"
    )


def test_a_schedule_conservativeness_and_eos_requests_round_trip_and_a_default_one_is_left_out() -> None:
    pressed = attrs.evolve(
        TRACE,
        setup=SchedulerSetup(num_blocks=8, eos=True, schedule_conservativeness=0.3),
        program=[AddRequest([1] * 14, 9, eos=True), Step()],
    )
    data = pressed.to_json()
    assert data["config"]["schedule_conservativeness"] == 0.3 and data["program"][0]["eos"] is True
    assert from_json(data) == pressed and from_json(data).digest() == pressed.digest()
    assert "schedule_conservativeness" not in TRACE.to_json()["config"]  # older traces keep their bytes and digest
    assert "schedule conservativeness 0.3" in pressed.setup.describe()
    data["config"]["schedule_conservativeness"] = 0
    with pytest.raises(SchedulerTraceError, match=r"config.schedule_conservativeness: 0 is not above 0 and at most 10"):
        from_json(data)


def test_vllm_refuses_a_schedule_conservativeness_other_than_one() -> None:
    from kvfuzz.scheduler.swarm import DIMENSIONS

    [row] = [row for row in DIMENSIONS if row.name == "schedule_conservativeness"]
    assert row.domain == (1.0,)  # vLLM's table never draws another (vllm_build.vllm_config refuses one)
