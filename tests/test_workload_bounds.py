"""Workloads are bounded before work: a prompt, an output, a sample count, a request count, an arrival or a file that
makes a workload impossible or enormous is refused with one line naming the limit (exit status 2) before any token
is derived; Ctrl-C during a replay is one line; long commands print progress on standard error, never on standard
output."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from factories import kvfuzz

from kvfuzz.cli import main
from kvfuzz.workload import format as workload_format
from kvfuzz.workload import scheduler as workload_scheduler
from kvfuzz.workload.format import (
    FORMAT,
    MAX_PROMPT_TOKENS,
    MAX_REQUESTS,
    MAX_SAMPLES,
    MAX_STEPS,
    MAX_WORKLOAD_BYTES,
    MAX_WORKLOAD_PROMPT_TOKENS,
    WorkloadError,
    parse_workload,
)

ROOT = Path(__file__).resolve().parent.parent


def _workload(*requests: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"format": FORMAT, "name": "w", "origin": "constructed", "requests": list(requests), **fields}


def _request(number: int = 0, **fields: Any) -> dict[str, Any]:
    return {"id": f"r{number}", "arrival": 0, "prompt_len": 4, "output_len": 2, **fields}


@pytest.fixture
def nothing_derived(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any token is derived: the bounds must hold before."""

    def derive(name: str, count: int) -> tuple[int, ...]:
        raise AssertionError(f"{count} tokens derived for {name} before the bounds were checked")

    monkeypatch.setattr(workload_format, "derived_tokens", derive)


BEYOND = {
    "a prompt of 10^9 tokens": (_workload(_request(prompt_len=10**9)), f"limit of {MAX_PROMPT_TOKENS:,} tokens"),
    "a prefix group of 10^9 tokens": (
        _workload(_request(prefix_group="g"), prefix_groups={"g": {"length": 10**9}}),
        f"limit of {MAX_PROMPT_TOKENS:,} tokens",
    ),
    "a group and a prompt over the limit together": (
        _workload(_request(prefix_group="g", prompt_len=MAX_PROMPT_TOKENS), prefix_groups={"g": {"length": 1}}),
        f"its prompt of {MAX_PROMPT_TOKENS + 1:,} tokens is over the limit",
    ),
    "prompts over the workload's limit together": (
        _workload(*(_request(number, prompt_len=MAX_PROMPT_TOKENS) for number in range(5))),
        f"limit of {MAX_WORKLOAD_PROMPT_TOKENS:,} tokens per workload",
    ),
    "an arrival at 10^12": (_workload(_request(arrival=10**12)), f"limit of {MAX_STEPS:,} steps"),
    "an output longer than a replay": (_workload(_request(output_len=10**9)), f"limit of {MAX_STEPS:,} steps"),
    "an output that cannot finish after its arrival": (
        _workload(_request(arrival=MAX_STEPS - 10, output_len=11)),
        f"limit of {MAX_STEPS:,} steps",
    ),
    "10^6 samples": (_workload(_request(samples=10**6)), f"limit of {MAX_SAMPLES} samples"),
}


@pytest.mark.parametrize("case", sorted(BEYOND))
def test_a_workload_beyond_a_limit_is_refused_before_any_token_is_derived(case: str, nothing_derived: None) -> None:
    data, limit = BEYOND[case]
    with pytest.raises(WorkloadError, match="over the limit|cannot finish") as refused:
        parse_workload(data)
    assert limit in str(refused.value) and "\n" not in str(refused.value)


def test_the_limits_themselves_are_accepted() -> None:
    at_limits = _workload(
        _request(0, prompt_len=MAX_PROMPT_TOKENS - 1, prefix_group="g", samples=MAX_SAMPLES),
        _request(1, arrival=MAX_STEPS - 1, output_len=1),
        prefix_groups={"g": {"length": 1}},
    )
    workload = parse_workload(at_limits)
    assert len(workload.requests[0].prompt) == MAX_PROMPT_TOKENS


def test_too_many_requests_are_refused_before_any_is_read(nothing_derived: None) -> None:
    many = _workload(*([None] * (MAX_REQUESTS + 1)))  # not even valid requests: the count is checked first
    with pytest.raises(WorkloadError, match=f"{MAX_REQUESTS + 1:,} requests is over the limit of {MAX_REQUESTS:,}"):
        parse_workload(many)


def test_the_cli_refuses_an_impossible_workload_at_once(tmp_path: Path) -> None:
    """Before: a prompt of 10^9 tokens spent minutes and gigabytes before the check that it cannot fit, and an
    arrival at 10^12 was reported as a replay crash (exit 1) after 100,000 empty steps."""
    for name, data in (("prompt", BEYOND["a prompt of 10^9 tokens"][0]), ("arrival", BEYOND["an arrival at 10^12"][0])):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        started = time.monotonic()
        done = kvfuzz("replay-workload", path.name, cwd=tmp_path)
        assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
        (line,) = done.stderr.splitlines()
        assert line.startswith("kvfuzz: ") and ("over the limit" in line or "cannot finish" in line)
        assert time.monotonic() - started < 60


def test_a_workload_file_over_the_size_limit_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / "huge.json"
    with open(path, "wb") as handle:  # sparse: the size is what is checked, before a byte is read
        handle.truncate(MAX_WORKLOAD_BYTES + 1)
    with pytest.raises(WorkloadError, match=f"over the limit of {MAX_WORKLOAD_BYTES // 2**20} MiB"):
        workload_format.load_workload(path)
    csv = tmp_path / "huge.csv"
    with open(csv, "wb") as handle:
        handle.truncate(MAX_WORKLOAD_BYTES + 1)
    done = kvfuzz("serve", f"azure-csv:{csv}", cwd=tmp_path)
    assert done.returncode == 2 and "over the limit" in done.stderr


@pytest.mark.slow
def test_a_poisson_workload_of_too_many_requests_is_refused(tmp_path: Path) -> None:
    serve = kvfuzz("serve", "poisson:0.5", "--requests", str(10**7), cwd=tmp_path)
    assert serve.returncode == 2 and f"limit of {MAX_REQUESTS:,} requests" in serve.stderr
    capacity = kvfuzz("capacity", "--requests", str(10**7), cwd=tmp_path)
    assert capacity.returncode == 2 and f"limit of {MAX_REQUESTS:,} requests" in capacity.stderr


def _serialised(tmp_path: Path) -> Path:
    """Three requests of 42 positions each, in a pool of 48 (4-slot blocks): they run one after the other, some 90
    steps in all."""
    path = tmp_path / "serialised.json"
    path.write_text(json.dumps(_workload(*[_request(number, prompt_len=12, output_len=30) for number in range(3)])))
    return path


POOL = ["--block-size", "4", "--num-blocks", "12"]


def test_a_workload_that_does_not_drain_within_the_step_limit_is_one_line_and_exit_2_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: ``crash (ReplayError)``, exit status 1, a failure blamed on an allocator that broke nothing. Now the
    replay stops at its step limit (40 here, 100,000 in use) and says why, in one line, exit status 2; the same
    workload drains when the limit allows."""
    path = _serialised(tmp_path)
    assert main(["replay-workload", str(path), *POOL]) == 0
    assert "3 finished" in capsys.readouterr().out
    limited = functools.partialmethod(workload_scheduler.Scheduler.__init__, max_steps=40)
    monkeypatch.setattr(workload_scheduler.Scheduler, "__init__", limited)
    # the check before the replay would refuse it (it needs 55 steps at least): off, so that the replay meets the
    # limit, as a workload does whose requests take longer than that lower bound says
    monkeypatch.setattr(workload_scheduler, "minimum_steps", lambda *args: 0)
    assert main(["replay-workload", str(path), *POOL]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith("kvfuzz: workload w did not drain within 40 steps"), line
    assert "no invariant broke" in line and "crash" not in line and "still open (r" in line


def test_a_long_replay_prints_its_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: minutes without a line. Now every few seconds (every step here) a line on standard error says where
    the replay is and when its step limit would come."""
    from kvfuzz.allocator.paged import paged_allocator
    from kvfuzz.allocator.types import PoolSpec
    from kvfuzz.engine.config import MachineConfig

    monkeypatch.setattr(workload_scheduler, "PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(workload_scheduler, "minimum_steps", lambda *args: 0)  # as above: the replay meets its limit
    workload = workload_format.load_workload(_serialised(tmp_path))
    config = MachineConfig(block_size=4, num_blocks=12, num_host_blocks=0)
    lines: list[str] = []
    replay = workload_scheduler.Scheduler(
        workload, paged_allocator(PoolSpec(4, 12, 0)), config, "paged", max_steps=40, progress=lines.append
    )
    report = replay.run()
    assert not report.failed and report.undrained is not None and report.steps == 40
    assert len(lines) == 40 and "w: step 1 after " in lines[0], lines[:2]
    assert "of 3 requests done" in lines[-1] and "a replay stops at step 40" in lines[-1], lines[-1]


@pytest.mark.slow
def test_ctrl_c_during_replay_workload_is_one_line(tmp_path: Path) -> None:
    requests = [_request(number, arrival=number, prompt_len=40, output_len=400) for number in range(400)]
    (tmp_path / "long.json").write_text(json.dumps(_workload(*requests)))
    child = subprocess.Popen(
        [sys.executable, "-m", "kvfuzz.cli", "replay-workload", "long.json", "--pool-positions", "8192"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        # as in a terminal: a shell that ran this session in the background (cmd &) left SIGINT ignored, and a child
        # inherits that, so that Python would install no KeyboardInterrupt and the Ctrl-C would be lost
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        time.sleep(8)  # torch imported, the replay under way (it runs for minutes)
        assert child.poll() is None, "the replay ended before it could be interrupted"
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 130, err
    assert "Traceback" not in out + err
    # the replay's progress lines (every few seconds: "w: step ...") may come first; then the one line
    said = [line for line in err.strip().splitlines() if line and not line.lstrip().startswith("w: step ")]
    assert said == ["kvfuzz: replay-workload interrupted (Ctrl-C) before it finished: nothing to report"]


@pytest.mark.slow
def test_long_commands_print_progress_on_standard_error_only(tmp_path: Path) -> None:
    zoo = kvfuzz("zoo", "--only", "NoCopyOnWrite", "--examples", "300", "--json", cwd=tmp_path)
    assert json.loads(zoo.stdout)[0]["variant"] == "NoCopyOnWrite"
    assert "zoo: NoCopyOnWrite caught as expected (1 of 1)" in zoo.stderr
    capacity = kvfuzz("capacity", "--rates", "0.5", "--requests", "4", "--block-sizes", "16", "--json", cwd=tmp_path)
    assert capacity.returncode in (0, 1), capacity.stderr
    assert len(json.loads(capacity.stdout)) == 2
    assert "paged" in capacity.stderr and "replaying 4 requests at 0.5 per step" in capacity.stderr
    ablate = kvfuzz("ablate", "--requests", "4", "--json", cwd=tmp_path)
    assert ablate.returncode in (0, 1), ablate.stderr
    rows = json.loads(ablate.stdout)
    assert f"serving baseline = {rows[0]['setting']} (1 of {len(rows)})" in ablate.stderr


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(["replay-workload"], marks=pytest.mark.slow),
        ["serve"],
        pytest.param(["ablate"], marks=pytest.mark.slow),
    ],
    ids=["replay-workload", "serve", "ablate"],
)
def test_a_large_workload_file_is_announced_before_it_is_read(command: list[str], tmp_path: Path) -> None:
    """Before: only replay-workload said it was reading a large file; serve and ablate read one in silence."""
    source = ROOT / "workloads" / "constructed" / "shared-system-prompt.json"
    large = tmp_path / "large.json"
    large.write_text(source.read_text() + " " * 2**20)  # the same workload, over a MiB of file
    done = kvfuzz(*command, str(large), "--json", cwd=tmp_path)
    assert done.returncode in (0, 1), done.stderr
    json.loads(done.stdout)  # standard output holds the JSON alone
    assert f"kvfuzz: reading the workload {large} (1.0 MiB)" in done.stderr, done.stderr


def test_a_workload_that_cannot_drain_within_the_step_limit_is_refused_before_the_replay(tmp_path: Path) -> None:
    """Before: each request was valid on its own, the replay ran its 100,000 steps for minutes, then reported
    "crash (ReplayError)" with exit status 1. Now the steps its requests need at least are counted first."""
    requests = [{"id": f"r{i}", "arrival": 0, "prompt_len": 3, "output_len": 5000} for i in range(60)]
    workload = {
        "format": "kvfuzz-workload/1",
        "name": "too-long",
        "origin": "constructed",
        "provenance": {"kind": "constructed", "generator": "tests", "seed": 0},
        "description": "60 requests of 5,000 output tokens each",
        "requests": requests,
    }
    (tmp_path / "too-long.json").write_text(json.dumps(workload))
    done = kvfuzz("replay-workload", "too-long.json", "--pool-positions", "6000", cwd=tmp_path, timeout=120)
    assert (done.returncode, done.stdout) == (2, ""), done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "kvfuzz: workload too-long cannot drain within the 100,000 steps a replay runs: its 60 requests' outputs need "
        "at least 125,551 steps, at most 256 running at once (--max-running), each holding its blocks in a pool of "
        "375 blocks (a larger pool, or fewer or shorter requests, drain sooner)"
    ]
    # fewer and shorter requests in the same pool drain
    small = {**workload, "requests": [dict(request, output_len=500) for request in requests[:2]]}
    (tmp_path / "fits.json").write_text(json.dumps(small))
    served = kvfuzz("replay-workload", "fits.json", "--pool-positions", "6000", "--json", cwd=tmp_path, timeout=600)
    assert served.returncode == 0, served.stderr
