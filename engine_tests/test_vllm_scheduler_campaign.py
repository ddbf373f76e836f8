"""``kvfuzz campaign --scheduler vllm-v1`` on vLLM 0.33.0 (docs/scheduler-campaigns.md): a campaign finds a
seeded historical bug (issue #11562, patched back in by engine_tests/vllm_history.py), saves its shrunk trace, and
a second campaign knowing that trace counts it as known; a short campaign on 0.33.0 as released reports nothing, and
its seed reruns it step for step; a batch drawn with async scheduling runs the engine core's batch queue, one drawn
without it the synchronous loop; a step that hangs is a hang finding, and a batch whose process is killed keeps its
program (``--isolate``). About a minute in vLLM's environment."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from engine_tests.vllm_history import touch_before_the_capacity_check
from kvfuzz.campaign.scheduler.loop import SchedulerCampaignOptions
from kvfuzz.campaign.scheduler.target import vllm_target
from kvfuzz.campaign.scheduler.workers import run_scheduler_campaign
from kvfuzz.cli import main
from kvfuzz.scheduler.trace import PROCESS_DIED, load

LATER_ROWS = {
    "speculative_tokens": 0,
    "cache_salts": False,
    "stop_tokens": False,
    "eos": False,
    "min_tokens": False,
    "model": "full",
    "kv_connector": "none",
    "transfer_delay": 0,
    "load_failures": False,
    "max_loras": 0,
    "prefix_resets": False,
    "kv_events": False,
    "stats": False,
    "overlong_requests": False,
    "prefix_match_unit": 0,
    "sessions": False,
    "drafter": "ngram",
    "kv_events_full": False,
    "long_prefill_token_threshold": 0,
    "long_prefill_token_threshold_adaptive": False,
    "max_num_active_seqs": 0,
    "prefill_schedule_interval": 1,
    "pauses": False,
    "load_failure_policy": "recompute",
    "skip_prefix_reads": False,
    "retention": "semantic",
    "chunked_prefill": True,
    "mamba_checkpoints": False,
}
"""Swarm rows added after these tests were written, and the value each is held at here: held without drawing, so
each seed draws the configurations the tests name (seed 3's first batch async, seed 7's async then synchronous);
what the rows themselves draw is tested in tests/test_scheduler_campaign.py."""


@pytest.fixture(autouse=True)
def _the_swarm_these_seeds_were_chosen_for(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfuzz.scheduler import swarm
    from kvfuzz.swarm_table import Dimension

    held = tuple(
        Dimension(row.name, row.domain, lambda rng, domain, value=LATER_ROWS[row.name]: value)
        if row.name in LATER_ROWS
        else row
        for row in swarm.DIMENSIONS
    )
    monkeypatch.setattr(swarm, "DIMENSIONS", held)


def campaign_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    status = main(["campaign", "--scheduler", "vllm-v1", "--json", *args])
    return status, json.loads(capsys.readouterr().out)


def test_a_seeded_bug_is_found_saved_and_then_known(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    touch_before_the_capacity_check(monkeypatch)
    first = tmp_path / "first"
    args = ("--seed", "3", "--max-examples", "100", "--stop-after", "1", "--corpus", str(first), "--no-known")
    status, result = campaign_json(capsys, *args)
    assert status == 1, result
    [finding] = result["failures"]
    assert finding["text"].startswith("accounting: "), finding
    assert finding["shrunk_length"] is not None and finding["reproduced"] == 1, finding
    trace = load(Path(finding["trace"]))
    assert trace.shrunk and trace.failure.check == "accounting"
    assert [path.name for path in first.glob("*.json")] == [Path(finding["trace"]).name]  # the unshrunk replaced
    assert result["seed"] == 3 and "--seed 3" in result["rerun_command"] and result["ended_by"] == "stop-after"

    # the same seed and count run the same batches, up to and past the one that met the bug (not the first: seed 3's
    # first batch draws async scheduling, which does not meet it)
    status, known = campaign_json(
        capsys, "--seed", "3", "--max-examples", "100", "--corpus", str(tmp_path / "second"), "--known", str(first)
    )
    assert status == 0 and not known["failures"], known
    assert [finding["text"] for finding in known["known"]] == [finding["text"]]
    assert known["known"][0]["known"] == finding["trace"]


def test_a_clean_campaign_reports_nothing_and_its_seed_reruns_it(tmp_path: Path) -> None:
    def run(corpus: str) -> Any:
        options = SchedulerCampaignOptions("vllm-v1", 5, tmp_path / corpus, max_examples=20, batch_examples=10)
        return run_scheduler_campaign(options, vllm_target("vllm-v1"))

    one, two = run("one"), run("two")
    assert not one.findings and one.batches == 2, one.to_json()
    assert (one.examples, one.steps) == (two.examples, two.steps) and one.steps > 0


def test_a_batch_drawn_with_async_scheduling_runs_the_batch_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvfuzz.scheduler.async_batches import BatchQueue, SynchronousLoop

    counts = tmp_path / "loops.jsonl"  # (the loop's kind, the setup's async_scheduling) of each step, from the worker

    def counting(kind: type) -> Any:
        step = kind.step

        def counted(self: Any, engine: Any) -> Any:
            with open(counts, "a") as log:
                log.write(json.dumps([kind.__name__, engine.setup.async_scheduling]) + "\n")
            return step(self, engine)

        return counted

    for kind in (BatchQueue, SynchronousLoop):
        monkeypatch.setattr(kind, "step", counting(kind))
    # seed 7 draws async scheduling for its first batch and synchronous scheduling for its second
    options = SchedulerCampaignOptions("vllm-v1", 7, tmp_path / "c", max_examples=10, batch_examples=5, shrink=False)
    result = run_scheduler_campaign(options, vllm_target("vllm-v1"))
    assert [batch["async_scheduling"] for batch in result.batch_log] == [True, False], result.batch_log
    loops = {tuple(json.loads(line)) for line in counts.read_text().splitlines()}
    assert loops == {("BatchQueue", True), ("SynchronousLoop", False)}, loops


def test_a_step_that_hangs_is_a_hang_finding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule = Scheduler.schedule

    def hanging(self: Any) -> Any:
        if len(self.running) >= 2:
            while True:
                time.sleep(0.01)
        return schedule(self)

    monkeypatch.setattr(Scheduler, "schedule", hanging)
    options = SchedulerCampaignOptions(
        "vllm-v1", 1, tmp_path / "c", max_examples=40, batch_examples=20, shrink=False, call_timeout=0.5
    )
    result = run_scheduler_campaign(options, vllm_target("vllm-v1"))
    assert [finding.text for finding in result.new] == ["hang: a step that does not return"], result.to_json()
    trace = load(Path(str(result.new[0].trace)))
    assert trace.failure.check == "hang" and "hanging" in trace.failure.message, trace.failure


def test_an_isolated_batch_killed_keeps_its_program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule = Scheduler.schedule

    def killing(self: Any) -> Any:
        if len(self.running) >= 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return schedule(self)

    monkeypatch.setattr(Scheduler, "schedule", killing)
    options = SchedulerCampaignOptions("vllm-v1", 1, tmp_path / "c", max_examples=40, batch_examples=20, isolate=True)
    result = run_scheduler_campaign(options, vllm_target("vllm-v1"))
    assert [finding.text for finding in result.new] == [f"crash ({PROCESS_DIED})"], result.to_json()
    assert "SIGKILL" in str(result.new[0].note)
    trace = load(Path(str(result.new[0].trace)))
    assert trace.failure.exception == PROCESS_DIED and not trace.shrunk
    assert trace.program, "the journal held the adds and steps before the kill (here in the drain after them)"
    assert not list((tmp_path / "c").glob(".kvfuzz-journal-*")), "the journal is removed"


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["campaign", "--scheduler", "vllm-v1", "--known", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"kvfuzz: --known {tmp_path / 'nowhere'}: not a directory"]


def test_a_pinned_row_is_what_every_batch_draws(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pins = ("--pin", "speculative_tokens=2", "--pin", "model_runner=V2")  # the first held at 0 above: the pin wins
    args = ("--seed", "5", "--max-examples", "6", "--batch-examples", "2", "--corpus", str(tmp_path), "--no-known")
    status, result = campaign_json(capsys, *args, *pins)
    assert status in (0, 1), result
    assert result["pins"] == {"speculative_tokens": 2, "model_runner": "V2"}
    assert len(result["batch_log"]) >= 2 and result["steps"] > 0
    assert all(batch["speculative_tokens"] == 2 and batch["model_runner"] == "V2" for batch in result["batch_log"])
    assert " ".join(pins) in result["rerun_command"]


def test_two_workers_run_batches_of_their_own_into_one_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--seed", "5", "--max-examples", "20", "--batch-examples", "5", "--corpus", str(tmp_path), "--no-known")
    status, result = campaign_json(capsys, *args, "--workers", "2")
    assert status in (0, 1) and result["workers"] == 2 and result["errors"] == [], result
    assert [entry["worker"] for entry in result["per_worker"]] == [0, 1]
    assert all(entry["steps"] > 0 for entry in result["per_worker"]), result["per_worker"]
    assert sum(entry["steps"] for entry in result["per_worker"]) == result["steps"]
    assert {batch["worker"] for batch in result["batch_log"]} == {0, 1}
    seeds = [batch["hypothesis_seed"] for batch in result["batch_log"]]
    assert len(set(seeds)) == len(seeds), "each worker draws from a seed stream of its own"
    assert "--workers 2" in result["rerun_command"]


def test_a_guided_campaign_keeps_seeds_and_runs_mutants_of_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The coverage feedback every target shares (kvfuzz/campaign/feedback.py) on the real scheduler: examples that
    reached new engine code kept as seeds, and mutant batches of them (half the batches until mutants have run)."""
    corpus = tmp_path / "corpus"
    args = ("--seed", "5", "--max-examples", "120", "--batch-examples", "8", "--corpus", str(corpus), "--no-known")
    status, result = campaign_json(capsys, *args, "--guided")
    assert status in (0, 1), result
    seeds = [json.loads(path.read_text()) for path in (corpus / ".kvfuzz-campaign" / "seeds").glob("vllm-v1-*.json")]
    assert seeds and all(seed["target"] == "vllm-v1" and seed["program"] for seed in seeds)
    mutated = [entry for entry in result["batch_log"] if entry["mutated_seed"]]
    assert mutated and all(entry["examples"] > 0 for entry in mutated), result["batch_log"]
    assert result["coverage"]["lines_reached"] > 0 and result["rerun"]["guided"]
    assert "--guided" in result["rerun_command"]
