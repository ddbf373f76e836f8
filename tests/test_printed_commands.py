"""Every command kvfuzz prints works as printed (issue 45, item 9): a run against a user's own allocator
(``MODULE:FACTORY``, not registered) prints ``kvfuzz replay`` and ``kvfuzz show`` with ``--trust-allocator``, since
the user named that allocator; the page ``show`` writes by default lands beside the trace. Each printed command is
run as printed."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OWN = """\
from kvfuzz.registry import load_factory

make = load_factory("zoo:NoCopyOnWrite")
"""


def _kvfuzz(arguments: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-m", "kvfuzz.cli", *arguments],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_the_commands_a_run_against_the_user_s_own_allocator_prints_work_as_printed(tmp_path: Path) -> None:
    """Before: "replay it with: kvfuzz replay ..." was refused ("not trusted") for the user's own allocator."""
    (tmp_path / "mine.py").write_text(OWN)
    found = _kvfuzz(["run", "--allocator", "mine:make", "--corpus", "found"], tmp_path)
    assert found.returncode == 1, found.stdout + found.stderr
    printed = {
        line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in found.stdout.splitlines() if ": kvfuzz " in line
    }
    replay = printed["replay it with"]
    show = printed["see it as a timeline"].split(" (writes ")[0]
    assert "--trust-allocator" in replay and "--trust-allocator" in show
    replayed = _kvfuzz(shlex.split(replay)[1:], tmp_path)
    assert replayed.returncode == 1 and "REPRODUCED" in replayed.stdout, replayed.stdout + replayed.stderr
    shown = _kvfuzz(shlex.split(show)[1:], tmp_path)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    (trace,) = (tmp_path / "found").glob("*.json")
    assert trace.with_suffix(".html").is_file()  # the page, beside its trace
    assert not list(tmp_path.glob("*.html"))


def test_a_registered_allocator_s_commands_need_no_trust() -> None:
    from kvfuzz.trace_saving import default_page, replay_hint, show_hint

    trace = Path("corpus") / "x y.json"
    assert replay_hint(trace, "zoo:NoCopyOnWrite") == "replay it with: kvfuzz replay 'corpus/x y.json'"
    assert replay_hint(trace, "mine:make") == "replay it with: kvfuzz replay --trust-allocator 'corpus/x y.json'"
    assert show_hint(trace, "kvfuzz") == (
        "see it as a timeline: kvfuzz show 'corpus/x y.json' (writes 'corpus/x y.html')"
    )
    assert default_page(trace) == Path("corpus") / "x y.html"


pytest_plugins = ["pytester"]


def test_a_trace_that_could_not_be_saved_prints_a_replay_that_trusts_the_user_s_allocator(tmp_path: Path) -> None:
    """Before: "trace NOT saved ... replay it with: kvfuzz replay NAME", refused for the user's own allocator."""
    from kvfuzz.engine.config import MachineConfig
    from kvfuzz.saved.corpus import save_trace
    from kvfuzz.saved.trace import Trace

    record = {"invariant": None, "title": "crash", "operation": None, "explanation": "x"}
    trace = Trace("mine:make", MachineConfig(), (), record, None)
    blocked = tmp_path / "a file where the corpus would be"
    blocked.write_text("")
    report = save_trace(trace, blocked).report()
    assert f"save it as {trace.file_name()} and replay it with: kvfuzz replay --trust-allocator " in report, report
    registered = save_trace(attrs_evolve(trace, "zoo:NoCopyOnWrite"), blocked)
    assert f"replay it with: kvfuzz replay {registered.trace.file_name()}\n" in registered.report()


def test_a_scheduler_trace_s_commands_are_quoted_as_an_allocator_trace_s_are(tmp_path: Path) -> None:
    """Before: a scheduler trace's report wrote its own lines, ``kvfuzz show PATH`` unquoted, which a path with a
    space broke when pasted; both kinds now print the one report (kvfuzz/trace_saving.py)."""
    from test_scheduler_traces import TRACE

    from kvfuzz.scheduler.recorder import save_scheduler_trace

    saved = save_scheduler_trace(TRACE, tmp_path / "my corpus")
    path = f"'{tmp_path}/my corpus/{TRACE.file_name()}'"
    assert saved.report().splitlines() == [
        f"trace saved to {tmp_path}/my corpus/{TRACE.file_name()}",
        f"replay it with: kvfuzz replay {path}",
        f"see it as a timeline: kvfuzz show {path} (writes {path[:-6]}.html')",
    ]


def attrs_evolve(trace, allocator: str):  # type: ignore[no-untyped-def]
    import attrs

    return attrs.evolve(trace, allocator=allocator)


def test_the_plugin_s_failure_prints_a_replay_that_trusts_the_user_s_allocator(pytester: pytest.Pytester) -> None:
    """Before: the plugin's "trace: PATH (replay it with: kvfuzz replay PATH)" was refused for ``mine:make``."""
    pytester.makepyfile(mine=OWN)
    pytester.syspathinsert()
    failed = pytester.runpytest("--kvfuzz-allocator=mine:make", "--kvfuzz-examples=50", "-p", "no:cacheprovider")
    failed.assert_outcomes(failed=1)
    lines = [line for line in failed.stdout.lines if "trace: " in line and "replay it with" in line]
    assert lines, failed.stdout.str()  # once in the failure, and again in the short summary where CI untruncates it
    for line in lines:
        trace = line.split("trace: ", 1)[1].split(" (", 1)[0]
        assert f"(replay it with: kvfuzz replay --trust-allocator {shlex.quote(trace)})" in line, line


def test_kvfuzz_findings_prints_a_replay_that_trusts_the_user_s_allocator(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``kvfuzz findings -o DIR`` printed "replay them with: kvfuzz replay FILES" for ``mine:make``."""
    from types import SimpleNamespace

    from kvfuzz.commands.findings import _table

    def finding(key: str, allocator: str) -> SimpleNamespace:
        return SimpleNamespace(
            key=key,
            text="invariant 5",
            signature=SimpleNamespace(allocator=allocator),
            trace=SimpleNamespace(program=()),
            machine="m",
            time="t",
        )

    _table([finding("a", "zoo:NoCopyOnWrite"), finding("b", "mine:make")], {"a": "a.json", "b": "b b.json"}, "redis:")
    assert "replay them with: kvfuzz replay --trust-allocator a.json 'b b.json'" in capsys.readouterr().out
    _table([finding("a", "zoo:NoCopyOnWrite")], {"a": "a.json"}, "redis:")
    assert "replay them with: kvfuzz replay a.json\n" in capsys.readouterr().out
