"""What keeps an SGLang scheduler failure from being lost when SGLang's own code misbehaves (docs/scheduler.md,
"SGLang failures and traces", "SGLang campaigns"): a step that loops forever is interrupted by the watchdog and
reported by the hang check with the program that got there, saved, and replayed (``kvfuzz run`` and ``kvfuzz
campaign``); and with ``--isolate`` a step that kills the process (``os._exit``, SIGSEGV) ends only the batch's child:
the campaign reports the finding and keeps its program as a trace, whose replay kills a process again.

Each bug is a monkeypatch of SGLang's ``ScheduleBatch.prepare_for_decode`` that misbehaves once two requests decode
together. Runs in SGLang's own environment (``scripts/third_party_env.sh sglang``; CI runs it there)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from kvfuzz.campaign.scheduler.loop import SchedulerCampaignOptions
from kvfuzz.campaign.scheduler.sglang_target import sglang_target
from kvfuzz.campaign.scheduler.workers import run_scheduler_campaign
from kvfuzz.cli import main
from kvfuzz.program.safeguards import Watchdog
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.sglang.build import sglang
from kvfuzz.scheduler.sglang.traces import sglang_version
from kvfuzz.scheduler.trace import PROCESS_DIED, load

CORPUS = Path(__file__).resolve().parent.parent / "corpus"
"""Its known SGLang bug (the ignore_eos clip's hang without the radix cache) is known to the campaigns here."""

ROOMY = (("num_blocks", 16), ("block_size", 4), ("prefix_caching", True))
"""The campaigns' pinned rows: a pool where two requests decode together in the first batch, and no prompt leaves
SGLang's clip a max_new_tokens of 0 (a prefill-only request, which kvfuzz's loop does not drive: docs)."""

NEVER_INTERRUPTED = 10.0
"""Seconds the patched step loops before giving up with a crash of its own: far past the tests' watchdog (0.5 s), so
an uninterrupted loop fails the test (a crash, not a hang) instead of hanging it."""


def _decode_misbehaving(monkeypatch: pytest.MonkeyPatch, misbehave: Callable[[], None]) -> None:
    """SGLang's ``prepare_for_decode`` calls ``misbehave()`` once two requests decode together."""
    batch_class = sglang().ScheduleBatch
    original = batch_class.prepare_for_decode

    def prepare_for_decode(self: Any) -> None:
        if len(self.reqs) >= 2:
            misbehave()
        original(self)

    monkeypatch.setattr(batch_class, "prepare_for_decode", prepare_for_decode)


def loop_forever() -> None:
    started = time.monotonic()
    while True:
        time.sleep(0.01)
        if time.monotonic() - started > NEVER_INTERRUPTED:
            raise RuntimeError("the watchdog never interrupted this step")


def test_a_step_that_loops_forever_is_a_hang_finding_saved_and_replayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _decode_misbehaving(monkeypatch, loop_forever)
    corpus = tmp_path / "corpus"
    argv = ["run", "--scheduler", "sglang", "--examples", "25", "--no-shrink", "--call-timeout", "0.5"]
    assert main([*argv, "--corpus", str(corpus), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["check"] == "hang", result["explanation"]
    assert "did not return within 0.5 s (--call-timeout); interrupted in" in result["explanation"]
    assert "loop_forever" in result["explanation"]  # where the interrupt found the step
    saved = sorted(corpus.glob("sglang-*.json"))
    assert [str(path) for path in saved] == [result["trace"]]
    trace = load(saved[0])
    assert trace.scheduler == "sglang" and trace.failure.check == "hang" and trace.program

    with Watchdog(0.5) as watchdog:
        replayed = replay(trace, watchdog=watchdog)
    assert replayed.reproduced and replayed.identical, replayed.describe_failure()
    assert main(["replay", str(saved[0]), "--call-timeout", "0.5"]) == 1  # the failure it recorded, reproduced
    assert "REPRODUCED" in capsys.readouterr().out
    monkeypatch.undo()
    with Watchdog(0.5) as watchdog:
        assert not replay(trace, watchdog=watchdog).failed  # SGLang as released: the program passes


def test_a_campaign_reports_a_step_that_loops_forever_as_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _decode_misbehaving(monkeypatch, loop_forever)
    options = SchedulerCampaignOptions(
        "sglang",
        1,
        tmp_path / "c",
        max_examples=20,
        batch_examples=10,
        known=(CORPUS,),
        shrink=False,
        call_timeout=0.5,
        pins=ROOMY,
    )
    result = run_scheduler_campaign(options, sglang_target("sglang"))
    assert [finding.text for finding in result.new] == ["hang: a step that does not return"], result.to_json()
    trace = load(Path(str(result.new[0].trace)))
    assert trace.failure.check == "hang" and "loop_forever" in trace.failure.message, trace.failure


def _exit_at_once() -> None:
    os._exit(3)


def _segfault() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


@pytest.mark.parametrize(
    "kill, how",
    [(_exit_at_once, "exited with status 3 without a result"), (_segfault, "was killed by signal 11 (SIGSEGV)")],
)
def test_an_isolated_batch_killed_mid_step_keeps_its_program_and_its_replay_kills_again(
    kill: Callable[[], None], how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _decode_misbehaving(monkeypatch, kill)
    corpus = tmp_path / "c"
    options = SchedulerCampaignOptions(
        "sglang", 1, corpus, max_examples=20, batch_examples=10, known=(CORPUS,), isolate=True, pins=ROOMY
    )
    target = sglang_target("sglang")
    result = run_scheduler_campaign(options, target)
    assert [finding.text for finding in result.new] == [f"crash ({PROCESS_DIED})"], result.to_json()
    assert how in str(result.new[0].note)
    trace = load(Path(str(result.new[0].trace)))
    assert trace.scheduler == "sglang" and trace.vllm_version == sglang_version() and trace.model_runner == ""
    assert trace.failure.exception == PROCESS_DIED and not trace.shrunk
    assert sum(operation.to_json()["op"] == "add" for operation in trace.program) >= 2, trace.program
    assert not list(corpus.glob(".kvfuzz-journal-*")), "the journal is removed"

    child = multiprocessing.get_context("fork").Process(target=replay, args=(trace,))
    child.start()
    child.join(60)
    assert child.exitcode == (3 if kill is _exit_at_once else -signal.SIGSEGV)  # the program kills SGLang again

    monkeypatch.undo()
    assert not replay(trace).failed  # SGLang as released: the program passes


def test_campaign_isolate_is_taken_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["campaign", "--scheduler", "sglang", "--seed", "7", "--max-examples", "4", "--batch-examples", "2"]
    assert main([*argv, "--corpus", str(tmp_path / "c"), "--no-known", "--isolate", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["failures"] == [] and result["examples"] == 4 and result["rerun"]["isolate"] is True
