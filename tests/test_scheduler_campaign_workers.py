"""``kvfuzz campaign --scheduler NAME --workers N`` without an engine (the fake scheduler of
tests/test_scheduler_campaign.py): the scheduler target on the campaign's one supervisor. Every worker draws batches
of its own, their findings are one table, a failure found by a worker that is killed while shrinking it is kept,
Ctrl-C stops every worker, a harness error in any worker ends the campaign, and ``--json`` gives each worker's
steps. On vLLM and SGLang: engine_tests/test_vllm_scheduler_campaign.py and
engine_tests/test_sglang_scheduler_traces.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
from test_scheduler_campaign import FakeTarget, buggy

from kvfuzz.campaign.scheduler.loop import SchedulerCampaignOptions
from kvfuzz.campaign.scheduler.workers import run_scheduler_campaign
from kvfuzz.scheduler.harness import HarnessError
from kvfuzz.scheduler.search import Outcome
from kvfuzz.scheduler.swarm import SwarmConfig
from kvfuzz.scheduler.trace import load


def campaign(fake: FakeTarget, corpus: Path, workers: int = 2, seed: int = 9, **options: Any) -> Any:
    settings = SchedulerCampaignOptions("vllm-v1", seed, corpus, max_examples=options.pop("max_examples", 600))
    return run_scheduler_campaign(attrs.evolve(settings, workers=workers, **options), fake.target())


def test_two_workers_draw_batches_of_their_own_and_find_the_failure_once(tmp_path: Path) -> None:
    fake = FakeTarget()
    result = campaign(fake, tmp_path / "c")
    seeds = fake.processes
    assert len(seeds) == 2, "each worker runs its own searches, in its own process"
    first, second = (set(found) for found in seeds.values())
    assert not first & second, "the workers' Hypothesis seeds come from streams of their own"
    # one table: the failure both met is one finding, claimed (shrunk and saved) once, counted every time
    [finding] = result.new
    assert finding.text == "accounting: the free count" and finding.seen > 1
    assert [path.name for path in (tmp_path / "c").glob("*.json")] == [Path(str(finding.trace)).name]
    assert load(Path(str(finding.trace))).shrunk and len([s for s in fake.searches if s[4]]) == 1
    assert {batch["worker"] for batch in result.batch_log} == {0, 1}
    as_json = result.to_json()
    json.dumps(as_json)
    assert as_json["workers"] == 2 and "--workers 2" in as_json["rerun_command"]
    per_worker = as_json["per_worker"]
    assert [entry["worker"] for entry in per_worker] == [0, 1]
    assert all(entry["steps"] > 0 for entry in per_worker)
    assert sum(entry["steps"] for entry in per_worker) == as_json["steps"]
    # a batch that fails early gives back the examples it did not run; a worker may find the budget spent while
    # another's batch still holds some (then given back unused): at most --max-examples, never more
    assert sum(entry["examples"] for entry in per_worker) == as_json["examples"]
    assert 500 < as_json["examples"] <= 600


def test_one_worker_runs_the_campaign_s_own_seed_stream(tmp_path: Path) -> None:
    """A one-worker campaign repeats the batches its seed always ran: reruns of earlier campaigns still hold."""
    one, two = FakeTarget(), FakeTarget()
    campaign(one, tmp_path / "one", workers=1, seed=11)
    campaign(two, tmp_path / "two", workers=2, seed=11)
    [first_worker] = one.processes.values()
    assert any(
        found == first_worker[: len(found)] or first_worker == found[: len(first_worker)]
        for found in two.processes.values()
    )


def test_a_failure_found_by_a_worker_killed_while_shrinking_is_kept(tmp_path: Path) -> None:
    fake = FakeTarget()
    search = fake.search

    def killed(config: SwarmConfig, examples: int, seed: int, shrink: bool, *rest: Any) -> Outcome:
        if shrink:
            os.kill(os.getpid(), signal.SIGKILL)  # the engine kills the worker while it shrinks
        return search(config, examples, seed, shrink, *rest)

    fake.search = killed  # type: ignore[method-assign]
    result = campaign(fake, tmp_path / "c", workers=1, max_examples=300)
    assert result.dead_workers, "the worker died"
    [finding] = [finding for finding in result.new if finding.text == "accounting: the free count"]
    assert finding.trace is not None and Path(finding.trace).exists(), "saved as found, before shrinking"
    trace = load(Path(finding.trace))
    assert not trace.shrunk and buggy(trace.setup)


def test_ctrl_c_stops_every_worker(tmp_path: Path) -> None:
    fake = FakeTarget()
    search = fake.search
    parent = os.getpid()

    sent = tmp_path / "interrupted"

    def interrupted(config: SwarmConfig, *rest: Any) -> Outcome:
        # whichever worker first sees eight searches logged (both may log at once: "== 8" can be skipped) sends one
        # Ctrl-C: the file's exclusive creation lets one worker through
        if len(fake.searches) >= 8:
            with contextlib.suppress(FileExistsError):
                os.close(os.open(sent, os.O_CREAT | os.O_EXCL))
                os.kill(parent, signal.SIGINT)
        time.sleep(0.05)
        return search(config, *rest)

    fake.search = interrupted  # type: ignore[method-assign]
    started = time.monotonic()
    result = campaign(fake, tmp_path / "c", max_examples=None, duration=120.0)
    # interrupted, well before its two minutes (a generous bound: a loaded machine is slow to start two workers)
    assert result.ended_by == "interrupted" and time.monotonic() - started < 100, result.ended_by
    assert len(fake.processes) == 2 and len(fake.searches) < 40


def test_ctrl_c_cuts_off_a_batch_that_would_outlast_the_campaign(tmp_path: Path) -> None:
    """Ctrl-C reaches a worker in the middle of a search without shrinking (a batch of minutes): it is cut off where
    it is, and every worker ends."""
    fake = FakeTarget()
    parent = os.getpid()
    sent = tmp_path / "interrupted"

    def endless(config: SwarmConfig, *rest: Any) -> Outcome:
        with contextlib.suppress(FileExistsError):
            os.close(os.open(sent, os.O_CREAT | os.O_EXCL))
            os.kill(parent, signal.SIGINT)
        while True:  # only the cut-off ends it
            time.sleep(0.01)

    fake.search = endless  # type: ignore[method-assign]
    started = time.monotonic()
    result = campaign(fake, tmp_path / "c", max_examples=None, duration=120.0)
    assert result.ended_by == "interrupted" and time.monotonic() - started < 100, result.ended_by
    assert not result.dead_workers and not result.new


def test_a_harness_error_in_any_worker_ends_the_campaign(tmp_path: Path) -> None:
    fake = FakeTarget()
    search = fake.search

    def broken(config: SwarmConfig, *rest: Any) -> Outcome:
        found = search(config, *rest)
        if len(fake.searches) >= 6:  # whichever worker runs the sixth search
            return attrs.evolve(found, failure=None, harness=HarnessError("Traceback ...", "kvfuzz: harness error"))
        time.sleep(0.05)
        return found

    fake.search = broken  # type: ignore[method-assign]
    started = time.monotonic()
    result = campaign(fake, tmp_path / "c", max_examples=None, duration=120.0)
    assert result.ended_by == "harness error" and time.monotonic() - started < 30
    assert result.errors and "kvfuzz: harness error" in result.errors[0]
    assert len(fake.searches) < 20


def test_the_cli_takes_workers_and_exits_3_on_a_harness_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfuzz.cli import _parser
    from kvfuzz.commands.scheduler_campaign import scheduler_campaign

    fake = FakeTarget()
    fake.search = lambda config, *rest: Outcome(  # type: ignore[method-assign]
        config.setup, 1, 1, 0, 0, 0.0, None, "", harness=HarnessError("Traceback ...", "kvfuzz: harness error")
    )
    argv = ["campaign", "--scheduler", "vllm-v1", "--workers", "2", "--max-examples", "50", "--corpus", str(tmp_path)]
    assert scheduler_campaign(_parser().parse_args([*argv, "--no-known"]), print, fake.target()) == 3
    out = capsys.readouterr().out
    assert "on 2 workers" in out and "harness error" in out


SUPERVISOR_KILLED = """
import os, signal, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
import attrs
from test_scheduler_campaign import FakeTarget
from kvfuzz.campaign.scheduler.loop import SchedulerCampaignOptions
from kvfuzz.campaign.scheduler.workers import run_scheduler_campaign
from kvfuzz.scheduler.trace import journal_configuration

fake = FakeTarget()
search = fake.search

def killing(config, examples, seed, shrink, *rest):
    if shrink:
        print(os.getpid(), flush=True)  # the worker
        os.kill(os.getppid(), signal.SIGKILL)  # the campaign's supervisor, killed while the worker shrinks
        time.sleep(60)
    return search(config, examples, seed, shrink, *rest)

fake.search = killing
options = SchedulerCampaignOptions("vllm-v1", 9, Path({corpus!r}), max_examples=400, call_timeout=1.0, workers=2)
run_scheduler_campaign(options, fake.target())
"""


@pytest.mark.slow
def test_a_failure_found_while_the_supervisor_is_killed_is_kept_and_the_workers_end(tmp_path: Path) -> None:
    import subprocess
    import sys

    corpus = tmp_path / "c"
    script = SUPERVISOR_KILLED.format(tests=str(Path(__file__).parent), corpus=str(corpus))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    worker = int(done.stdout.split()[0])
    deadline = time.monotonic() + 30  # the orphaned worker stops its shrink and ends, well within its patience
    while time.monotonic() < deadline and os.path.exists(f"/proc/{worker}"):
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{worker}"), "the worker outlived its campaign"
    traces = [load(path) for path in corpus.glob("*.json")]
    assert traces and all(not trace.shrunk and buggy(trace.setup) for trace in traces), "kept, as found"


BOTH_KILLED = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_scheduler_campaign import FOUND, FakeTarget
from kvfuzz.campaign.scheduler.loop import SchedulerCampaignOptions
from kvfuzz.campaign.scheduler.workers import run_scheduler_campaign
from kvfuzz.scheduler.trace import journal_configuration

fake = FakeTarget()

def killing(config, examples, seed, shrink, witness, call_timeout, journal):
    journal.begin_example(journal_configuration(config.setup, config.model_runner))
    for operation in FOUND:
        journal.call(operation.to_json())  # the engine kills the process in FOUND's last step, and its supervisor
    print(os.getpid(), flush=True)
    os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)

fake.search = killing
options = SchedulerCampaignOptions("vllm-v1", 9, Path({corpus!r}), max_examples=400, workers=1)
run_scheduler_campaign(options, fake.target())
"""


@pytest.mark.slow
def test_a_program_whose_supervisor_and_worker_both_died_is_a_finding_of_the_next_campaign(tmp_path: Path) -> None:
    import subprocess
    import sys

    from test_scheduler_campaign import FOUND

    corpus = tmp_path / "c"
    script = BOTH_KILLED.format(tests=str(Path(__file__).parent), corpus=str(corpus))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    worker = int(done.stdout.split()[0])
    assert not list(corpus.glob("*.json")), "nothing saved yet: the program is in the dead worker's journal alone"
    fake = FakeTarget()
    fake.search = lambda config, examples, *rest: Outcome(config.setup, examples, 5, 0, 0, 0.01, None, "")  # type: ignore[method-assign]
    result = campaign(fake, corpus, workers=1, max_examples=50)
    [finding] = result.new
    assert finding.text == "crash (SchedulerProcessDied)", finding.text
    assert f"pid {worker}" in (finding.note or "") and "recovered at the campaign's start" in (finding.note or "")
    assert finding.trace is not None
    trace = load(Path(finding.trace))
    assert trace.program == FOUND and not trace.shrunk and f"pid {worker}" in trace.failure.message
    assert not list(corpus.glob(".kvfuzz-journal-*")), "the journal became the trace"
    # the next campaign knows it: counted, never a new finding twice
    again = campaign(FakeTarget(), corpus, workers=1, max_examples=50)
    assert "crash (SchedulerProcessDied)" not in [finding.text for finding in again.new]
