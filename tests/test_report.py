"""``kvfuzz report``: bad input is one line and exit status 2 with nothing written; a vLLM scheduler trace's report
holds the configuration, the program, the failure and a reproducer that imports no kvfuzz (written beside it too); a
trace whose failure only kvfuzz's reference sees gets a report saying why it has no reproducer; an allocator trace
gets a report naming the replay; an SGLang hang's reproducer plays its program on SGLang's pieces, and another SGLang
failure gets a report saying why it has none. (Running the reproducers against the engines:
engine_tests/test_vllm_reports.py, engine_tests/test_sglang_reports.py.)"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from kvfuzz.cli import main
from kvfuzz.scheduler.fake_model import expected_output
from kvfuzz.scheduler.speculative import proposal

CORPUS = Path(__file__).resolve().parent.parent / "corpus"
PADDING = CORPUS / "vllm-v1-scheduler-speculative-padding-hang-6123748f32e9.json"


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"not json", "not valid JSON"),
        (b'{"format": "kvfuzz-scheduler-trace/1"}', "program: missing"),
        (b'{"format": "kvfuzz-trace/9"}', "bad.json"),
    ],
)
def test_a_file_that_is_not_a_trace_is_one_line_and_exit_2(
    content: bytes, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.json").write_bytes(content)
    assert main(["report", "bad.json"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("kvfuzz: ") and says in error
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bad.json"]


def test_an_unreadable_trace_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "missing.json"), "-o", str(tmp_path / "out.md")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "missing.json" in error
    assert list(tmp_path.iterdir()) == []


def test_a_report_that_would_overwrite_the_trace_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.json"
    trace.write_bytes(PADDING.read_bytes())
    assert main(["report", str(trace), "-o", str(trace)]) == 2
    assert "is the input TRACE" in capsys.readouterr().err
    assert trace.read_bytes() == PADDING.read_bytes()


def test_a_vllm_scheduler_trace_s_report_holds_a_reproducer_that_imports_no_kvfuzz(tmp_path: Path) -> None:
    output = tmp_path / "padding.md"
    assert main(["report", str(PADDING), "-o", str(output)]) == 0
    text = output.read_text()
    reproducer = (tmp_path / "padding_reproducer.py").read_text()
    assert reproducer in text
    assert "kvfuzz run --scheduler vllm-v1 --num-blocks 16 --block-size 4" in text
    assert "--speculative-tokens 16" in text
    assert "add(prompt=[0, 1, 2, 0, 0], max_tokens=1)" in text
    assert "progress check failed at step 2, request r1" in text
    assert "vLLM 0.33.0 accepts num_speculative_tokens" in text
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(ast.parse(reproducer))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert imported == {"vllm", "torch", "os", "json", "tempfile", "zlib", "dataclasses", "mmap"}
    assert 'engine.add("r1", [0, 1, 2, 0, 0], 1)' in reproducer and "engine.drain()" in reproducer


def test_the_reproducer_s_model_samples_what_kvfuzz_s_fake_model_does(tmp_path: Path) -> None:
    """The tables written into the reproducer are the fake model's tokens and the worker's drafts."""
    output = tmp_path / "padding.md"
    assert main(["report", str(PADDING), "-o", str(output)]) == 0
    tables: dict[str, object] = {}
    for node in ast.parse((tmp_path / "padding_reproducer.py").read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("SAMPLED", "DRAFTS"):
                tables[node.targets[0].id] = eval(compile(ast.Expression(node.value), "reproducer", "eval"))
    sampled, drafts = tables["SAMPLED"], tables["DRAFTS"]
    assert isinstance(sampled, dict) and isinstance(drafts, dict)
    assert sampled["r1"][5:9] == expected_output("r1", 5, 4)
    assert drafts["r0"][6] == proposal("r0", 6, 16)


def test_a_trace_only_kvfuzz_s_reference_sees_gets_a_report_saying_so(tmp_path: Path) -> None:
    recorded = json.loads((CORPUS / "vllm-v1-scheduler-issue-23316-victim-keeps-tokens-02ea5ce953c3.json").read_text())
    recorded["failure"].update(check="content", message="content check failed at step 7, request r1: other K/V")
    trace = tmp_path / "content.json"
    trace.write_text(json.dumps(recorded))
    output = tmp_path / "r.md"
    assert main(["report", str(trace), "-o", str(output)]) == 0
    assert "None generated: its failure is kvfuzz's content check" in output.read_text()
    assert not (tmp_path / "r_reproducer.py").exists()


MAMBA_HANG = CORPUS / "vllm-v1-scheduler-mamba-partial-hit-admission-hang-d591b6629908.json"
SESSION_RESET = CORPUS / "vllm-v1-scheduler-session-blocks-reset-error-c18d23100ce4.json"
SESSION_GATE = CORPUS / "vllm-v1-scheduler-mamba-session-resume-gate-hang-ad7ef67d44b6.json"
RSWA_GAP = CORPUS / "vllm-v1-scheduler-rswa-session-gap-a102da1e3f89.json"


def test_a_mamba_hybrid_or_session_trace_gets_a_reproducer_that_builds_what_it_needs(tmp_path: Path) -> None:
    """The Mamba hybrid is built by vLLM's planner with partial hits; a session's first turn is added resumable, its
    later turns are calls, a reset is a call, and the drain closes the sessions left open."""
    assert main(["report", str(MAMBA_HANG), "-o", str(tmp_path / "m.md")]) == 0
    mamba = (tmp_path / "m_reproducer.py").read_text()
    assert "MODEL = 'mamba-hybrid'" in mamba and "PREFIX_MATCH_UNIT = 1" in mamba and "planned_kv_cache" in mamba
    assert main(["report", str(SESSION_RESET), "-o", str(tmp_path / "s.md")]) == 0
    session = (tmp_path / "s_reproducer.py").read_text()
    assert 'engine.add("r0", [0], 1, resumable=True)' in session
    assert "engine.reset_prefix_cache(preempt=True)" in session and "closes every open session" in session
    assert main(["report", str(SESSION_GATE), "-o", str(tmp_path / "g.md")]) == 0
    turns = (tmp_path / "g_reproducer.py").read_text()
    assert "engine.resume('r1', [0], 1)" in turns and "engine.resume('r1', [0, 0], 1)" in turns
    assert main(["report", str(RSWA_GAP), "-o", str(tmp_path / "w.md")]) == 0
    rswa = (tmp_path / "w_reproducer.py").read_text()
    assert "MODEL = 'rswa'" in rswa and "RSWA_WINDOW = 8" in rswa and "self.check_reads(output)" in rswa
    assert "engine.resume('r0', [3], 4)" in rswa and "Failure('content at step ...')" in rswa


@pytest.mark.parametrize(
    ("trace", "edit", "reason"),
    [
        (MAMBA_HANG, {"failure": {"check": "accounting"}}, "states accounting on one KV-cache group"),
        (MAMBA_HANG, {"config": {"model": "chunked-local", "prefix_match_unit": 0}}, "the Mamba hybrid and R-SWA only"),
        (RSWA_GAP, {"failure": {"message": "content check failed at step 31, request r0: ... holds"}}, "content check"),
        (
            SESSION_RESET,
            {
                "program": [{"op": "resume", "request": "r0", "prompt": [1], "max_tokens": 1}],
                "config": {"min_tokens": True},
            },
            "a streaming session's later turns under min_tokens",
        ),
        (MAMBA_HANG, {"config": {"pauses": True}}, "the client's pauses are not played"),
    ],
    ids=["mamba-accounting", "chunked-local", "rswa-content", "resume", "pauses"],
)
def test_what_the_reproducer_does_not_play_is_named_in_one_line(
    tmp_path: Path, trace: Path, edit: dict[str, Any], reason: str
) -> None:
    recorded = json.loads(trace.read_text())
    for field, value in sorted(edit.items()):
        if field == "program":
            recorded["program"] = recorded["program"][:2] + value
        else:
            recorded[field] |= value
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(recorded))
    assert main(["report", str(edited), "-o", str(tmp_path / "r.md")]) == 0
    text = (tmp_path / "r.md").read_text()
    assert "None generated: " in text and reason in text, text[-600:]
    assert not (tmp_path / "r_reproducer.py").exists()


def test_an_allocator_trace_s_report_names_its_replay(tmp_path: Path) -> None:
    trace = CORPUS / "vllm-v1-kv-cache-manager-cache-soundness-382d392d8a83.json"
    output = tmp_path / "r.md"
    assert main(["report", str(trace), "-o", str(output)]) == 0
    text = output.read_text()
    assert "invariant 9 (cache soundness)" in text and f"kvfuzz replay {trace}" in text
    assert "PR #43569" in text


CLIP_HANG = CORPUS / "sglang-scheduler-ignore-eos-clip-hang-47fe19becd38.json"


def test_an_sglang_hang_s_reproducer_plays_its_program_and_imports_no_kvfuzz(tmp_path: Path) -> None:
    """Generated where SGLang is not needed (run against SGLang: engine_tests/test_sglang_reports.py)."""
    from kvfuzz.reproducers import scheduler_reproducer_source
    from kvfuzz.scheduler.fake_model import sampled_token
    from kvfuzz.scheduler.trace import load

    source = scheduler_reproducer_source(load(CLIP_HANG), "corpus/x.json")
    tree = ast.parse(source)
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not [name for name in imported if name.startswith("kvfuzz")]
    assert {name.split(".")[0] for name in imported} <= {
        "sglang",
        "torch",
        "ast",
        "enum",
        "importlib",
        "logging",
        "sys",
        "types",
        "typing",
        "array",
    }
    assert (
        'engine.add("r0", [0, 1, 2, 0, 1, 2, 0, 1, 0], max_new_tokens=7, ignore_eos=True)\n    engine.drain()' in source
    )
    assert "NUM_PAGES = 6 " in source and "PAGE_SIZE = 4\n" in source and "RADIX_CACHE = False " in source
    namespace: dict[str, object] = {}
    exec(source[source.index("SAMPLED = ") : source.index("\n", source.index("SAMPLED = "))], namespace)  # noqa: S102
    assert namespace["SAMPLED"] == {"r0": [sampled_token("r0", position) for position in range(9 + 7 + 2)]}


def test_an_sglang_trace_other_than_a_hang_gets_a_report_saying_why(tmp_path: Path) -> None:
    recorded = json.loads(CLIP_HANG.read_text())
    recorded["failure"].update(check="outputs", message="outputs check failed at step 3, request r0: other tokens")
    trace = tmp_path / "outputs.json"
    trace.write_text(json.dumps(recorded))
    output = tmp_path / "r.md"
    assert main(["report", str(trace), "-o", str(output)]) == 0
    assert "None generated: its failure is kvfuzz's outputs check: an SGLang scheduler reproducer states only" in (
        output.read_text()
    )
    assert not (tmp_path / "r_reproducer.py").exists()
