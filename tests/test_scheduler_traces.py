"""Scheduler traces in kvfuzz's own environment (no vLLM): the format's round trip and versioning, every refusal
one line naming the file and the field, the file kind told from the bytes, atomic saving, ``show`` and ``export``
(which need no vLLM), and ``replay`` and the pytest plugin skipping such a trace, with the reason, where vLLM is
missing. Replaying one against vLLM is engine_tests/test_vllm_scheduler_traces.py."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any, Callable

import attrs
import pytest

from kvfuzz.cli import main
from kvfuzz.scheduler import trace as scheduler_trace
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.program import Abort, AddRequest, Step
from kvfuzz.scheduler.trace import RecordedFailure, SchedulerTrace, SchedulerTraceError, from_json, load, save
from kvfuzz.scheduler.violations import Check, SchedulerViolation
from kvfuzz.trace_files import SCHEDULER_FORMAT, json_file_kind

pytest_plugins = ["pytester"]

VLLM_MISSING = importlib.util.find_spec("vllm") is None

TRACE = SchedulerTrace(
    scheduler="vllm-v1",
    setup=SchedulerSetup(num_blocks=8, max_num_seqs=2, prefix_caching=False),
    model_runner="V1",
    vllm_version="0.33.0",
    program=[AddRequest([1, 2, 3], 4), Step(), Abort("r0"), Step()],
    failure=RecordedFailure.of(SchedulerViolation(Check.ACCOUNTING, 2, "r0", "the manager reports 7 free blocks")),
    shrunk=True,
)


def test_async_scheduling_is_recorded_and_a_trace_without_it_is_synchronous() -> None:
    """The field is written only when true, so a trace from before it existed loads as synchronous and keeps its
    digest (and file name); an async trace round-trips, says so and hashes differently."""
    data = TRACE.to_json()
    assert "async_scheduling" not in data["config"]
    assert from_json(data).setup.async_scheduling is False and from_json(data).digest() == TRACE.digest()
    async_trace = attrs.evolve(TRACE, setup=attrs.evolve(TRACE.setup, async_scheduling=True))
    async_data = async_trace.to_json()
    assert async_data["config"]["async_scheduling"] is True
    loaded = from_json(async_data)
    assert loaded == async_trace and loaded.digest() != TRACE.digest()
    assert "prefix caching off, async scheduling" in loaded.describe()[1]
    async_data["config"]["async_scheduling"] = "yes"
    with pytest.raises(SchedulerTraceError, match=r"^trace: config.async_scheduling: must be true or false, not"):
        from_json(async_data)


def test_the_model_is_recorded_only_when_not_full_attention() -> None:
    """A trace from before ``config.model`` existed loads as the full-attention model and keeps its digest; a
    sliding-window trace round-trips, says so and hashes differently; an unknown model is refused in one line."""
    data = TRACE.to_json()
    assert "model" not in data["config"]
    assert from_json(data).setup.model == "full" and from_json(data).digest() == TRACE.digest()
    hybrid = attrs.evolve(TRACE, setup=attrs.evolve(TRACE.setup, model="sliding-window"))
    hybrid_data = hybrid.to_json()
    assert hybrid_data["config"]["model"] == "sliding-window"
    loaded = from_json(hybrid_data)
    assert loaded == hybrid and loaded.digest() != TRACE.digest()
    assert "model sliding-window: a four-layer Gemma 2" in loaded.describe()[1]
    hybrid_data["config"]["model"] = "mamba"
    with pytest.raises(SchedulerTraceError, match=r"^trace: config.model: "):
        from_json(hybrid_data)


def test_the_prefix_match_unit_is_recorded_only_where_set_and_checked_on_load() -> None:
    """A trace from before ``config.prefix_match_unit`` existed loads with hashes every block and keeps its digest; a
    partial-prefix-caching trace round-trips, says so and hashes differently; a unit the setup refuses is refused in
    one line naming the field."""
    data = TRACE.to_json()
    assert "prefix_match_unit" not in data["config"] and from_json(data).setup.hash_block_size == 4
    partial = attrs.evolve(
        TRACE, setup=attrs.evolve(TRACE.setup, model="mamba-hybrid", prefix_caching=True, prefix_match_unit=2)
    )
    partial_data = partial.to_json()
    assert partial_data["config"]["prefix_match_unit"] == 2
    loaded = from_json(partial_data)
    assert loaded == partial and loaded.digest() != attrs.evolve(partial, setup=TRACE.setup).digest()
    assert loaded.setup.hash_block_size == 2 and "prefix hashes every 2 token(s)" in loaded.describe()[1]
    partial_data["config"]["prefix_match_unit"] = 3
    with pytest.raises(SchedulerTraceError, match=r"^trace: config: prefix_match_unit must divide block_size 4"):
        from_json(partial_data)
    partial_data["config"]["prefix_match_unit"] = 5
    with pytest.raises(SchedulerTraceError, match=r"^trace: config.prefix_match_unit: "):
        from_json(partial_data)


@pytest.mark.parametrize(
    "changes, line",
    [
        ({"prefix_match_unit": 2}, "needs model mamba-hybrid with prefix caching"),
        ({"prefix_match_unit": 2, "model": "mamba-hybrid", "prefix_caching": False}, "needs model mamba-hybrid"),
        (
            {"prefix_match_unit": 4, "model": "mamba-hybrid"},
            "prefix_match_unit must divide block_size 4 and be smaller",
        ),
        ({"prefix_match_unit": -1, "model": "mamba-hybrid"}, "prefix_match_unit must divide block_size 4"),
    ],
)
def test_a_prefix_match_unit_vllm_would_not_serve_partial_hits_with_is_refused(
    changes: dict[str, Any], line: str
) -> None:
    with pytest.raises(ValueError, match=line):
        SchedulerSetup(**changes)


def test_a_trace_round_trips_and_names_its_kind() -> None:
    data = TRACE.to_json()
    assert data["format"] == "kvfuzz-scheduler-trace/1" == scheduler_trace.FORMAT == SCHEDULER_FORMAT
    assert data["engine"] == {"vllm_version": "0.33.0", "model_runner": "V1"}
    assert data["config"] == {
        "num_blocks": 8,
        "block_size": 4,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 2,
        "prefix_caching": False,
    }
    assert data["program"] == [
        {"op": "add", "prompt": [1, 2, 3], "max_tokens": 4},
        {"op": "step"},
        {"op": "abort", "request": "r0"},
        {"op": "step"},
    ]
    assert data["failure"] == {
        "check": "accounting",
        "exception": None,
        "step": 2,
        "request": "r0",
        "message": "accounting check failed at step 2, request r0: the manager reports 7 free blocks",
    }
    assert from_json(json.loads(json.dumps(data))) == TRACE


def test_speculative_decoding_is_recorded_and_a_trace_without_it_keeps_its_digest() -> None:
    import attrs

    speculative = attrs.evolve(TRACE, setup=attrs.evolve(TRACE.setup, speculative_tokens=2))
    data = speculative.to_json()
    assert data["config"]["speculative_tokens"] == 2
    assert from_json(json.loads(json.dumps(data))) == speculative
    assert speculative.digest() != TRACE.digest()
    # written before speculative decoding was driven: no field, no drafts, the digest it was saved under
    assert "speculative_tokens" not in TRACE.to_json()["config"]
    assert from_json(TRACE.to_json()).setup.speculative_tokens == 0
    assert TRACE.digest() == "41662bf53feb"


def test_a_non_default_write_path_and_attention_are_recorded_and_named() -> None:
    """Written only when not the defaults (older traces lack them and load as the defaults); part of the digest."""
    other = attrs.evolve(TRACE, write_path="vllm", attention="gather")
    assert other.to_json()["engine"] == {
        "vllm_version": "0.33.0",
        "model_runner": "V1",
        "write_path": "vllm",
        "attention": "gather",
    }
    assert (from_json(other.to_json()).write_path, from_json(other.to_json()).attention) == ("vllm", "gather")
    assert (from_json(TRACE.to_json()).write_path, from_json(TRACE.to_json()).attention) == ("kvfuzz", "off")
    assert other.digest() != TRACE.digest()
    assert other.describe()[0].endswith("V1 model runner protocol, write path vllm, attention gather")


def test_a_crash_is_recorded_with_its_exception_type() -> None:
    failure = RecordedFailure.of(AssertionError("seeded"))
    assert (failure.check, failure.exception, failure.message) == ("crash", "AssertionError", "AssertionError: seeded")
    assert failure.same_kind(RecordedFailure.of(AssertionError("other words")))
    assert not failure.same_kind(RecordedFailure.of(KeyError("seeded")))


def test_a_crash_without_a_message_says_where_and_which_statement(tmp_path: Path) -> None:
    """A bare ``assert`` in the engine reads as the statement that failed, on one line, and where it is (the path
    from the package directory on)."""
    source = tmp_path / "site-packages" / "engine" / "sched.py"
    source.parent.mkdir(parents=True)
    source.write_text("def schedule(running):\n    assert len(running) + 1 <= len(\n        running\n    )\n")
    spec = importlib.util.spec_from_file_location("engine_sched", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(AssertionError) as caught:
        module.schedule([1])
    failure = RecordedFailure.of(caught.value)
    assert failure.message == (
        "AssertionError at engine/sched.py:2 in schedule(): assert len(running) + 1 <= len(running)"
    ), failure.message
    assert failure.exception == "AssertionError"


def test_the_digest_names_configuration_runner_and_program() -> None:
    import attrs

    assert attrs.evolve(TRACE, shrunk=False).digest() == TRACE.digest()
    assert attrs.evolve(TRACE, model_runner="V2").digest() != TRACE.digest()
    assert attrs.evolve(TRACE, program=TRACE.program[:-1]).digest() != TRACE.digest()
    assert TRACE.file_name() == f"vllm-v1-accounting-{TRACE.digest()}.json"


def test_a_priority_trace_records_its_policy_and_priorities_and_an_fcfs_trace_reads_as_before() -> None:
    """The policy and each add's priority are written only where they differ from FCFS and 0, so that traces
    written before priority scheduling existed (corpus/vllm-v1-*.json) keep their bytes and digests."""
    import attrs

    priority = attrs.evolve(
        TRACE,
        setup=attrs.evolve(TRACE.setup, policy="priority"),
        program=[AddRequest([1, 2, 3], 4, priority=2), AddRequest([1], 1), Step()],
    )
    data = priority.to_json()
    assert data["config"]["policy"] == "priority"
    assert data["program"][:2] == [
        {"op": "add", "prompt": [1, 2, 3], "max_tokens": 4, "priority": 2},
        {"op": "add", "prompt": [1], "max_tokens": 1},
    ]
    assert from_json(json.loads(json.dumps(data))) == priority
    assert "policy" not in TRACE.to_json()["config"]
    assert priority.digest() != attrs.evolve(priority, setup=TRACE.setup).digest()
    assert "    1  add(prompt=[1, 2, 3], max_tokens=4, priority=2)" in priority.describe()
    assert "priority scheduling" in priority.describe()[1]


def test_cache_salts_and_stop_tokens_are_recorded_only_where_set() -> None:
    """A request's cache salt and stop token ids, and the search's switches for them, are written only where set, so
    that traces written before they existed (corpus/vllm-v1-*.json) keep their bytes and digests; a salted and
    stopping trace round-trips, reads in ``show`` and exports as calls that pass them on."""
    from kvfuzz.scheduler.export import export_test

    salted = attrs.evolve(
        TRACE,
        setup=attrs.evolve(TRACE.setup, cache_salts=True, stop_tokens=True),
        program=[AddRequest([1, 2, 3], 4, cache_salt="a", stop_token_ids=(2, 0)), AddRequest([1], 1), Step()],
    )
    data = salted.to_json()
    assert (data["config"]["cache_salts"], data["config"]["stop_tokens"]) == (True, True)
    assert data["program"][:2] == [
        {"op": "add", "prompt": [1, 2, 3], "max_tokens": 4, "cache_salt": "a", "stop_token_ids": [2, 0]},
        {"op": "add", "prompt": [1], "max_tokens": 1},
    ]
    assert from_json(json.loads(json.dumps(data))) == salted
    assert not {"cache_salts", "stop_tokens"} & TRACE.to_json()["config"].keys()
    assert salted.digest() != attrs.evolve(salted, program=[AddRequest([1, 2, 3], 4), *salted.program[1:]]).digest()
    assert "    1  add(prompt=[1, 2, 3], max_tokens=4, cache_salt='a', stop_token_ids=[2, 0])" in salted.describe()
    assert salted.describe()[1].endswith("prefix caching off, cache salts, stop tokens")
    exported = export_test(salted, "salted.json")
    assert "session.add([1, 2, 3], 4, cache_salt='a', stop_token_ids=[2, 0])" in exported
    assert "cache_salts=True, stop_tokens=True)" in exported


def test_eos_and_min_tokens_are_recorded_only_where_set() -> None:
    """A request's ``eos`` and ``min_tokens``, and the search's switches for them, are written only where set (a
    trace without them, every trace written before they existed, has every request ignore EOS, no min_tokens); a
    trace with them round-trips, reads in ``show`` and exports as calls that pass them on."""
    from kvfuzz.scheduler.export import export_test

    ending = attrs.evolve(
        TRACE,
        setup=attrs.evolve(TRACE.setup, eos=True, min_tokens=True),
        program=[AddRequest([1, 2, 3], 4, eos=True, min_tokens=2), AddRequest([1], 1), Step()],
    )
    data = ending.to_json()
    assert (data["config"]["eos"], data["config"]["min_tokens"]) == (True, True)
    assert data["program"][:2] == [
        {"op": "add", "prompt": [1, 2, 3], "max_tokens": 4, "eos": True, "min_tokens": 2},
        {"op": "add", "prompt": [1], "max_tokens": 1},
    ]
    assert from_json(json.loads(json.dumps(data))) == ending
    assert not {"eos", "min_tokens"} & TRACE.to_json()["config"].keys()
    assert ending.digest() != attrs.evolve(ending, program=[AddRequest([1, 2, 3], 4), *ending.program[1:]]).digest()
    assert "    1  add(prompt=[1, 2, 3], max_tokens=4, eos=True, min_tokens=2)" in ending.describe()
    assert ending.describe()[1].endswith("prefix caching off, EOS, min_tokens")
    exported = export_test(ending, "ending.json")
    assert "session.add([1, 2, 3], 4, eos=True, min_tokens=2)" in exported
    assert "eos=True, min_tokens=True)" in exported


def test_loras_are_recorded_only_where_set() -> None:
    """A request's LoRA adapter, and the setup's ``max_loras``, are written only where set (a trace without them,
    every trace written before LoRA was driven, has no adapter); a trace with them round-trips, reads in ``show``
    and exports as calls that pass them on; an adapter outside 1 .. max_loras + 1 is refused naming the field."""
    from kvfuzz.scheduler.export import export_test

    adapted = attrs.evolve(
        TRACE,
        setup=attrs.evolve(TRACE.setup, max_loras=2),
        program=[AddRequest([1, 2, 3], 4, lora=3), AddRequest([1], 1), Step()],
    )
    data = adapted.to_json()
    assert data["config"]["max_loras"] == 2
    assert data["program"][:2] == [
        {"op": "add", "prompt": [1, 2, 3], "max_tokens": 4, "lora": 3},
        {"op": "add", "prompt": [1], "max_tokens": 1},
    ]
    assert from_json(json.loads(json.dumps(data))) == adapted
    assert "max_loras" not in TRACE.to_json()["config"]
    assert adapted.digest() != attrs.evolve(adapted, program=[AddRequest([1, 2, 3], 4), *adapted.program[1:]]).digest()
    assert "    1  add(prompt=[1, 2, 3], max_tokens=4, lora=3)" in adapted.describe()
    assert adapted.describe()[1].endswith("prefix caching off, LoRA (at most 2 adapter(s) a step)")
    exported = export_test(adapted, "adapted.json")
    assert "session.add([1, 2, 3], 4, lora=3)" in exported
    assert ", max_loras=2)" in exported
    data["program"][0]["lora"] = 4
    with pytest.raises(SchedulerTraceError, match="^" + re.escape("trace: program[0].lora: 4 is not between 0 and 3")):
        from_json(data)
    plain = json.loads(json.dumps(TRACE.to_json()))
    plain["program"][0]["lora"] = 1  # no LoRA in the setup: no adapter
    with pytest.raises(SchedulerTraceError, match="^" + re.escape("trace: program[0].lora: 1 is not between 0 and 0")):
        from_json(plain)
    data["config"]["max_loras"] = 9
    with pytest.raises(SchedulerTraceError, match="^" + re.escape("trace: config.max_loras: 9 is not between 0 and 4")):
        from_json(data)


@pytest.mark.parametrize(
    "field, value, line",
    [
        ("min_tokens", 5, "program[0].min_tokens: 5 is not between 0 and {max_tokens}"),
        ("min_tokens", -1, "program[0].min_tokens: -1 is not between 0 and {max_tokens}"),
        ("eos", 1, "program[0].eos: must be true or false, not 1"),
    ],
)
def test_bad_eos_and_min_tokens_are_refused_naming_the_field(field: str, value: Any, line: str) -> None:
    data = json.loads(json.dumps(TRACE.to_json()))
    data["program"][0]["max_tokens"] = 4
    data["program"][0][field] = value
    with pytest.raises(SchedulerTraceError, match="^" + re.escape(f"trace: {line.format(max_tokens=4)}")):
        from_json(data)


@pytest.mark.parametrize(
    "stops, line",
    [
        ([1, 1], "program[0].stop_token_ids: must be a list of distinct tokens"),
        ([4], "program[0].stop_token_ids: 4 is not between 0 and 3"),
        ("1", "program[0].stop_token_ids: must be a list of distinct tokens"),
    ],
)
def test_bad_stop_token_ids_are_refused_naming_the_field(stops: Any, line: str) -> None:
    data = json.loads(json.dumps(TRACE.to_json()))
    data["program"][0]["stop_token_ids"] = stops
    with pytest.raises(SchedulerTraceError, match="^" + re.escape(f"trace: {line}")):
        from_json(data)


def edit(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    data = json.loads(json.dumps(TRACE.to_json()))
    change(data)
    return data


@pytest.mark.parametrize(
    "change, line",
    [
        (
            lambda d: d.update(format="kvfuzz-scheduler-trace/2"),
            "written by a newer kvfuzz (format kvfuzz-scheduler-trace/2); this kvfuzz reads kvfuzz-scheduler-trace/1",
        ),
        (lambda d: d.update(format="kvfuzz-trace/1"), 'not a scheduler trace ("format" is "kvfuzz-trace/1"; expected'),
        (lambda d: d.update(extra=1), "extra: unknown field (a trace's top level has only: format, "),
        (lambda d: d.pop("engine"), "engine: missing"),
        (lambda d: d.update(scheduler="llama-cpp"), 'scheduler: must be one of vllm-v1, sglang, not "llama-cpp"'),
        (lambda d: d["engine"].update(model_runner="V3"), 'engine.model_runner: must be one of V1, V2, not "V3"'),
        (lambda d: d["config"].update(num_blocks=0), "config.num_blocks: 0 is not between 1 and 65536"),
        (lambda d: d["config"].update(block_size=True), "config.block_size: must be an integer, not true"),
        (lambda d: d["config"].update(prefix_caching=1), "config.prefix_caching: must be true or false, not 1"),
        (lambda d: d["config"].update(policy="lifo"), 'config.policy: must be one of fcfs, priority, not "lifo"'),
        (lambda d: d["program"][0].update(priority="high"), 'program[0].priority: must be an integer, not "high"'),
        (lambda d: d["config"].update(speculative_tokens=-1), "config.speculative_tokens: -1 is not between 0 and 64"),
        (
            lambda d: d["config"].update(drafter="medusa"),
            "config.drafter: must be one of ngram, draft-model, parallel, eagle, ",
        ),
        (lambda d: d["config"].update(drafter="draft-model"), "config: drafter draft-model needs speculative decoding"),
        (lambda d: d["program"][0].update(prompt=[1, 9]), "program[0].prompt: 9 is not between 0 and 3"),
        (lambda d: d["program"][0].update(prompt=[]), "program[0].prompt: must be a list of 1..31 tokens"),
        (lambda d: d["program"][0].update(max_tokens=30), "program[0].max_tokens: 30 is not between 1 and 29"),
        (lambda d: d["program"][2].update(request="r1"), "program[2].request: must name a request added before it"),
        (lambda d: d["program"].insert(0, {"op": "reset"}), "program[0]: must be an object whose op is add, abort"),
        (lambda d: d["program"][1].update(extra=1), "program[1].extra: unknown field"),
        (lambda d: d["failure"].update(check="content-ish"), "failure.check: must be one of content, exclusive"),
        (lambda d: d["failure"].update(check="crash"), "failure.exception: must name the exception's type for a"),
        (lambda d: d["engine"].update(write_path="mine"), "engine.write_path: must be one of kvfuzz, vllm, not"),
        (lambda d: d["engine"].update(attention="flex"), "engine.attention: must be one of off, gather, vllm-triton"),
    ],
)
def test_a_bad_trace_is_refused_in_one_line_naming_the_field(
    tmp_path: Path, change: Callable[[dict[str, Any]], None], line: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(edit(change)))
    with pytest.raises(SchedulerTraceError) as caught:
        load(path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}: {line}"), message


def test_saving_is_atomic_and_once(tmp_path: Path) -> None:
    path, written = save(TRACE, tmp_path / "corpus")
    assert written and load(path) == TRACE and path.name == TRACE.file_name()
    assert save(TRACE, tmp_path / "corpus") == (path, False)
    path.write_text("{")  # a damaged file of the trace's name is replaced
    assert save(TRACE, tmp_path / "corpus") == (path, True) and load(path) == TRACE
    assert [entry.name for entry in (tmp_path / "corpus").iterdir()] == [path.name]  # no temporary file left


def test_the_file_kind_is_told_from_the_bytes(tmp_path: Path) -> None:
    path, _ = save(TRACE, tmp_path)
    assert json_file_kind(path) == "scheduler-trace"
    wide = tmp_path / "wide.json"
    wide.write_bytes(json.dumps(TRACE.to_json()).encode("utf-16"))
    assert json_file_kind(wide) == "scheduler-trace"
    allocator = tmp_path / "allocator.json"
    allocator.write_text('{"format": "kvfuzz-trace/1"}')
    assert json_file_kind(allocator) == "trace"


def test_show_and_export_need_no_vllm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = save(TRACE, tmp_path)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:7] == [
        "scheduler trace (kvfuzz-scheduler-trace/1) of vllm-v1, vLLM 0.33.0, V1 model runner protocol",
        "  8 blocks x 4 slots, token budget 16, at most 2 running, prefix caching off",
        "  shrunk: 4 operation(s), then the drain",
        "    1  add(prompt=[1, 2, 3], max_tokens=4)",
        "    2  step()",
        "    3  abort('r0')",
        "    4  step()",
    ]
    assert "failure: accounting check failed at step 2, request r0: the manager reports 7 free blocks" in out
    exported = tmp_path / "test_exported.py"
    assert main(["export", str(path), "-o", str(exported)]) == 0
    text = exported.read_text()
    compile(text, str(exported), "exec")
    assert "with model_runner('V1'):" in text and "session.add([1, 2, 3], 4)" in text
    assert "session.abort('r0')" in text and text.rstrip().endswith("session.drain()")
    assert "max_num_seqs=2" in text and "prefix_caching=False" in text


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["show", "T", "--allocator", "kvfuzz"],
            "a scheduler trace is replayed against its scheduler, not --allocator",
        ),
        (["export", "T", "--allocator", "kvfuzz"], "a scheduler trace takes no --allocator"),
        (
            ["replay", "T", "--allocator", "kvfuzz"],
            "a scheduler trace is replayed against its scheduler, not --allocator",
        ),
    ],
)
def test_options_of_allocator_traces_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], line: str
) -> None:
    path, _ = save(TRACE, tmp_path)
    assert main([str(path) if arg == "T" else arg for arg in argv]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err.splitlines()) == ("", [f"kvfuzz: {path}: {line}"])


@pytest.mark.skipif(not VLLM_MISSING, reason="vLLM is installed here: this is the refusal for environments without it")
@pytest.mark.parametrize("flag", ["--html", "--png"])
def test_a_timeline_asked_for_without_vllm_is_refused_in_one_line_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    path, _ = save(TRACE, tmp_path)
    out = tmp_path / ("page.html" if flag == "--html" else "page.png")
    assert main(["show", str(path), flag, str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    assert captured.err.startswith(f"kvfuzz: {flag}: drawing the timeline replays the trace, and a ")
    assert "is not installed here" in captured.err and not out.exists()


@pytest.mark.skipif(not VLLM_MISSING, reason="vLLM is installed here: this is the refusal for environments without it")
def test_replay_without_vllm_skips_the_trace_with_the_reason_as_for_an_absent_allocator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = save(TRACE, tmp_path)
    assert main(["replay", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.splitlines() == [
        f"{path}: skipped: a vllm-v1 trace needs vllm 0.33.0, which is not installed here; build its environment "
        "with scripts/third_party_env.sh vllm",
        "",
    ]


@pytest.mark.skipif(not VLLM_MISSING, reason="vLLM is installed here: this is the skip for environments without it")
def test_pytest_skips_a_scheduler_trace_where_vllm_is_missing(pytester: pytest.Pytester) -> None:
    save(TRACE, pytester.path / "corpus")
    result = pytester.runpytest("corpus", "-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*a vllm-v1 trace needs vllm 0.33.0, which is not installed here*"])


def test_pytest_fails_a_damaged_scheduler_trace_in_one_line(pytester: pytest.Pytester) -> None:
    (pytester.path / "corpus").mkdir()
    (pytester.path / "corpus" / "bad.json").write_text(json.dumps(edit(lambda d: d.update(shrunk="yes"))))
    result = pytester.runpytest("corpus", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(['*bad.json: shrunk: must be true or false, not "yes"*'])


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name


class _Worker:
    runner_v2 = False
    write_path = _Named("kvfuzz")  # the defaults, which a trace leaves out
    attention = _Named("off")


class _Session:
    """What the recorder reads of a session: its setup, its worker's runner, write path and attention, and the
    program so far."""

    def __init__(self, *program: Any) -> None:
        self.setup = TRACE.setup
        self.worker = _Worker()
        self.program = list(program)


@pytest.mark.parametrize("same_failure", [True, False], ids=["same failure", "another failure"])
def test_the_unshrunk_trace_gives_way_only_to_a_shrunk_trace_of_the_same_failure(
    same_failure: bool, tmp_path: Path
) -> None:
    """Hypothesis reports one failure, and when shrinking meets another kind of failure it may report that one: the
    first one's unshrunk trace then stays on disk beside it (before, it was deleted, and that failure lost)."""
    from kvfuzz.scheduler.recorder import FailureRecorder

    found = SchedulerViolation(Check.ACCOUNTING, 3, "r1", "block 1 has ref_cnt 3")
    reported = found if same_failure else SchedulerViolation(Check.CONTENT, 1, "r0", "slot 4 holds r1's K/V")
    recorder = FailureRecorder("vllm-v1", tmp_path)
    recorder(_Session(AddRequest([1, 2, 3, 4, 5], 2), Step(), AddRequest([1, 2], 1), Step()), found)
    first = recorder.first
    assert first is not None and first.path.exists()
    recorder(_Session(AddRequest([1], 1), Step()), reported)
    saved = recorder.finish(reported, shrunk=True)
    assert saved is not None and saved.path.exists() and load(saved.path).failure == RecordedFailure.of(reported)
    assert first.path.exists() is not same_failure
    assert len(list(tmp_path.glob("*.json"))) == (1 if same_failure else 2)


def test_the_kv_connector_is_recorded_only_where_set_and_refused_where_unknown() -> None:
    """A trace without a connector keeps its digest; one with the offloading connector, late transfers and load
    failures round-trips them (a replay needs them: they decide what the worker does); a bad value is refused."""
    assert not {"kv_connector", "transfer_delay", "load_failures"} & TRACE.to_json()["config"].keys()
    setup = attrs.evolve(TRACE.setup, kv_connector="offloading", transfer_delay=2, load_failures=True)
    data = attrs.evolve(TRACE, setup=setup).to_json()
    assert (data["config"]["kv_connector"], data["config"]["transfer_delay"], data["config"]["load_failures"]) == (
        "offloading",
        2,
        True,
    )
    assert from_json(data).setup == setup and from_json(data).digest() != TRACE.digest()
    data["config"]["kv_connector"] = "nixl"
    with pytest.raises(SchedulerTraceError, match=r"^trace: config.kv_connector: "):
        from_json(data)


def test_the_load_failure_policy_is_recorded_only_where_it_fails_requests() -> None:
    """vLLM's kv_load_failure_policy: absent (recompute) in every trace before it; "fail" round-trips; an unknown
    policy, or one without the P/D connector's failed loads, is refused."""
    setup = attrs.evolve(TRACE.setup, kv_connector="pd", load_failures=True)
    assert "load_failure_policy" not in attrs.evolve(TRACE, setup=setup).to_json()["config"]
    failing = attrs.evolve(setup, load_failure_policy="fail")
    data = attrs.evolve(TRACE, setup=failing).to_json()
    assert data["config"]["load_failure_policy"] == "fail" and from_json(data).setup == failing
    data["config"]["load_failure_policy"] = "retry"
    with pytest.raises(SchedulerTraceError, match=r"^trace: config.load_failure_policy: must be one of recompute"):
        from_json(data)
    data["config"].update(load_failure_policy="fail", load_failures=False)
    with pytest.raises(SchedulerTraceError, match=r"^trace: config: load_failure_policy fail needs failed loads"):
        from_json(data)


@pytest.mark.skipif(not VLLM_MISSING, reason="vLLM is installed here: this is the refusal for environments without it")
def test_the_plugin_s_scheduler_search_without_its_engine_is_a_usage_error_in_one_line(
    pytester: pytest.Pytester,
) -> None:
    result = pytester.runpytest("--kvfuzz-scheduler", "vllm-v1", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: --kvfuzz-scheduler vllm-v1 needs vLLM, which is not installed here; build its environment with "
            "scripts/third_party_env.sh vllm"
        ]
    )


def test_the_plugin_refuses_an_unknown_scheduler_target(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--kvfuzz-scheduler", "tgi", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kvfuzz-scheduler: invalid choice: 'tgi'*"])


def test_vllm_s_long_prefill_cap_admission_cap_and_cadence_round_trip_and_are_absent_at_their_defaults() -> None:
    capped = attrs.evolve(
        TRACE,
        setup=attrs.evolve(
            TRACE.setup,
            long_prefill_token_threshold=3,
            long_prefill_token_threshold_adaptive=True,
            max_num_active_seqs=1,
            prefill_schedule_interval=2,
        ),
    )
    config = capped.to_json()["config"]
    assert (
        config["long_prefill_token_threshold"],
        config["long_prefill_token_threshold_adaptive"],
        config["max_num_active_seqs"],
        config["prefill_schedule_interval"],
    ) == (3, True, 1, 2)
    assert from_json(json.loads(json.dumps(capped.to_json()))) == capped and capped.digest() != TRACE.digest()
    assert not {"long_prefill_token_threshold", "max_num_active_seqs", "prefill_schedule_interval"} & set(
        TRACE.to_json()["config"]
    )
    assert TRACE.digest() == "41662bf53feb", "a trace without them keeps the digest it was saved under"
    assert "at most 3 token(s) a request and step beside others (floored at a fair share" in capped.setup.describe()


@pytest.mark.parametrize(
    ("changes", "line"),
    [
        ({"long_prefill_token_threshold": 33}, "long_prefill_token_threshold must be 0 .no cap. .. max_model_len 32"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold must be 0"),
        ({"long_prefill_token_threshold_adaptive": True}, "needs long_prefill_token_threshold"),
        ({"max_num_active_seqs": 3}, r"max_num_active_seqs must be 0 \(unset\) .. max_num_seqs 2"),
        ({"prefill_schedule_interval": 0}, r"prefill_schedule_interval must be 1 \(every step\) .. 16"),
    ],
)
def test_a_cap_vllm_would_refuse_is_refused_in_one_line(changes: dict[str, Any], line: str) -> None:
    with pytest.raises(ValueError, match=line):
        SchedulerSetup(num_blocks=8, max_num_seqs=2, **changes)
    data = TRACE.to_json()
    data["config"].update(changes)
    with pytest.raises(SchedulerTraceError) as refused:
        from_json(data)
    assert "\n" not in str(refused.value) and "config" in str(refused.value)


def test_the_client_s_pauses_round_trip_and_are_refused_where_the_configuration_draws_none() -> None:
    from kvfuzz.scheduler.program import Pause, Unpause

    program = (AddRequest([1, 2], 3), Pause(), Step(), Pause(keep=True), Unpause(), Step())
    paused = attrs.evolve(TRACE, setup=attrs.evolve(TRACE.setup, pauses=True), program=program)
    data = paused.to_json()
    assert data["config"]["pauses"] is True
    assert data["program"][1:5] == [{"op": "pause"}, {"op": "step"}, {"op": "pause", "keep": True}, {"op": "unpause"}]
    assert from_json(json.loads(json.dumps(data))) == paused
    assert [operation.source("s") for operation in program[1:5]] == [
        "s.pause()",
        "s.step()",
        "s.pause(keep=True)",
        "s.unpause()",
    ]
    data["config"].pop("pauses")
    with pytest.raises(SchedulerTraceError, match=r"^trace: program\[1\]: must be an object whose op is add, abort"):
        from_json(data)
    with pytest.raises(ValueError, match="pauses are not driven with resumable requests"):
        SchedulerSetup(pauses=True, sessions=True)


def test_the_retention_and_the_skipped_reads_are_recorded_only_where_set() -> None:
    """Absent at their defaults (every trace before them reads and digests as it did); set, they round-trip; a
    retention vLLM does not apply to the model is refused."""
    assert not {"retention", "skip_prefix_reads"} & TRACE.to_json()["config"].keys()
    setup = attrs.evolve(TRACE.setup, model="sliding-window", retention="periodic", skip_prefix_reads=True)
    data = attrs.evolve(TRACE, setup=setup).to_json()
    assert (data["config"]["retention"], data["config"]["skip_prefix_reads"]) == ("periodic", True)
    assert from_json(data).setup == setup
    data["config"]["model"] = "mamba-hybrid"
    with pytest.raises(SchedulerTraceError, match=r"^trace: config: retention periodic is driven on the sliding"):
        from_json(data)


def test_chunked_prefill_off_is_recorded_only_where_set_and_caps_max_model_len_at_the_budget() -> None:
    """Absent when on (every trace before it reads and digests as it did); off, it round-trips, the target's
    max_model_len is capped at the token budget (vLLM refuses a longer one), and the configurations vLLM does not run
    it with are refused."""
    assert "chunked_prefill" not in TRACE.to_json()["config"]
    setup = attrs.evolve(TRACE.setup, chunked_prefill=False)
    data = attrs.evolve(TRACE, setup=setup).to_json()
    assert data["config"]["chunked_prefill"] is False
    assert from_json(data).setup == setup
    assert SchedulerSetup(num_blocks=8, max_num_batched_tokens=16).max_model_len == 32
    assert SchedulerSetup(num_blocks=8, max_num_batched_tokens=16, chunked_prefill=False).max_model_len == 16
    assert SchedulerSetup(num_blocks=2, max_num_batched_tokens=16, chunked_prefill=False).max_model_len == 8
    data["config"]["long_prefill_token_threshold"] = 2
    with pytest.raises(SchedulerTraceError, match=r"^trace: config: chunked prefill off is not driven with long_"):
        from_json(data)
    with pytest.raises(ValueError, match="chunked prefill off with model mamba-hybrid needs prefix caching off"):
        SchedulerSetup(model="mamba-hybrid", chunked_prefill=False)
    SchedulerSetup(model="mamba-hybrid", prefix_caching=False, chunked_prefill=False)
