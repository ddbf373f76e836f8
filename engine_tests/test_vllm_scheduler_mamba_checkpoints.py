"""Prefill checkpoints exported inside the forward pass (``--mamba-checkpoints``,
kvfuzz/scheduler/mamba_checkpoints.py): the Mamba hybrid's Mamba layers ask for a checkpoint block as vLLM's Mamba2
mixer does, vLLM's scheduler stops splitting the prompt's last chunk at its checkpoint and its Mamba manager reserves
and keys the block instead, and kvfuzz's runner writes the state there by vLLM's own rule. The unmodified scheduler
passes without partial hits; a runner that writes the checkpoint one block early (a seeded bug) is caught by the
Mamba state check; and the vLLM bug the first runs met (partial hits and checkpoints: a copy-on-write block keyed as
a full block it never held) replays on this release and passes without the checkpoints.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there): without vLLM the import fails
loudly rather than skipping."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import vllm.model_executor.layers.mamba.checkpoint as checkpoint

from engine_tests.vllm_seeded_runs import found_and_replayed
from kvfuzz.cli import main
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.trace import load
from kvfuzz.scheduler.violations import Check
from kvfuzz.scheduler.vllm_build import new_scheduler

OPTIONS = ["--model", "mamba-hybrid", "--mamba-checkpoints", "--block-size", "4"]
STALE_STATE = Path(__file__).parent / "data" / "mamba-checkpoint-partial-hit-stale-state.json"


def test_vllm_is_built_with_the_checkpoint_blocks() -> None:
    scheduler = new_scheduler(SchedulerSetup(model="mamba-hybrid", block_size=4, mamba_checkpoints=True))
    assert scheduler.mamba_has_prefill_checkpoint_blocks
    plain = new_scheduler(SchedulerSetup(model="mamba-hybrid", block_size=4))
    assert not plain.mamba_has_prefill_checkpoint_blocks


def test_the_unmodified_scheduler_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = ["run", "--scheduler", "vllm-v1", "--num-blocks", "8", *OPTIONS, "--examples", "100", "--seed", "3"]
    assert main([*run, "--corpus", str(tmp_path), "--json"]) == 0, capsys.readouterr().out
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] > 0


def checkpoint_one_block_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeded bug: vLLM's rule for the runner writes each checkpoint into the column before the one the scheduler
    reserved and keyed."""
    rule = checkpoint.compute_mamba_prefill_checkpoints

    def early(*args: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
        offsets, columns = rule(*args, **kwargs)
        return offsets, [column - 1 if column > 0 else column for column in columns]

    monkeypatch.setattr(checkpoint, "compute_mamba_prefill_checkpoints", early)


def test_a_checkpoint_written_one_block_early_is_caught(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint_one_block_early(monkeypatch)
    trace = found_and_replayed(capsys, tmp_path, OPTIONS, {Check.CONTENT}, "should hold a checkpoint of its prefix")
    assert trace.setup.mamba_checkpoints


def test_the_partial_hit_stale_state_replays_and_passes_without_checkpoints() -> None:
    trace = load(STALE_STATE)
    assert trace.known_bug and trace.known_bug.startswith("vLLM bug")
    replayed = replay(trace)
    assert replayed.reproduced and replayed.identical, replayed.describe_failure()
    without = replay(attrs.evolve(trace, setup=attrs.evolve(trace.setup, mamba_checkpoints=False)))
    assert not without.failed, without.describe_failure()
