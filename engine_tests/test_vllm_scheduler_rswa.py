"""R-SWA (reference sliding window attention) under vLLM's real v1 Scheduler (docs/scheduler-models.md#r-swa): a
llama whose layers keep the prompt visible and give generated tokens a window of 8 tokens besides, one KV-cache group
run by vLLM's ``RSWAManager``, which frees the blocks in the gap between the prompt and the window as a request
decodes. The unmodified scheduler passes with gaps freed and prefix-cache hits reached; the worker's rule reads the
prompt and the window (tests/test_scheduler_groups.py); each bug seeded into the gap's bounds is caught.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import attrs
import pytest
from vllm.v1.core.single_type_kv_cache_manager import RSWAManager
from vllm.v1.kv_cache_interface import RSWASpec

from engine_tests.vllm_seeded_runs import first_violation, found_and_replayed, shared_prefix_programs
from kvfuzz.cli import main
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.trace import load
from kvfuzz.scheduler.violations import Check, SchedulerViolation
from kvfuzz.scheduler.vllm_build import kv_cache_config

RSWA = SchedulerSetup(num_blocks=24, model="rswa")  # blocks of 4, a window of 8 tokens
PREFIX = [1, 2, 3, 0, 2, 2, 1, 3, 0]


def run_examples(setup: SchedulerSetup, examples: int) -> tuple[int, int]:
    """Random request programs with shared prefixes and long decodes, each drained: the most null entries (freed
    gap blocks) one request's table held, and the longest prefix-cache hit."""
    nulled, hits = shared_prefix_programs(setup, examples, PREFIX, 0.3, 3, 24, lambda session: [0])
    return max(nulled.values(), default=0), hits


def first_failure(examples: int = 30) -> SchedulerViolation:
    return first_violation(lambda: run_examples(RSWA, examples))


def test_vllm_plans_one_rswa_group_run_by_its_manager() -> None:
    config = kv_cache_config(RSWA)
    ((group,),) = [config.kv_cache_groups]
    assert isinstance(group.kv_cache_spec, RSWASpec) and group.kv_cache_spec.rswa_window == 8
    session = Session(RSWA)
    (manager,) = session.scheduler.kv_cache_manager.coordinator.single_type_managers
    assert type(manager) is RSWAManager
    (rule,) = session.worker.groups
    assert (rule.window, rule.keeps_prompt) == (8, True)
    assert RSWA.max_model_len == 24 * 4  # sized as full attention: the gap is unknown at admission


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_unmodified_scheduler_passes_with_gaps_freed_and_hits_reached(async_scheduling: bool) -> None:
    nulled, hits = run_examples(attrs.evolve(RSWA, async_scheduling=async_scheduling), 10)
    assert nulled > 0 and hits > 0, (nulled, hits)


# -- bugs seeded into vLLM's R-SWA manager -------------------------------------------------------------------------


def gap_into_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the gap ends a block late, freeing the window's first block while the next token attends it."""
    original = RSWAManager._remove_blocks_in_range

    def remove(self: Any, request_id: str, first_block: int, last_block: int) -> None:
        original(self, request_id, first_block, last_block + 1 if last_block > first_block else last_block)

    monkeypatch.setattr(RSWAManager, "_remove_blocks_in_range", remove)


def gap_into_the_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the gap starts at the block the prompt's last token is in (``num_prompt_tokens // block_size``,
    not rounded up), freeing a block of the prompt every token attends."""
    original = RSWAManager._remove_blocks_in_range

    def remove(self: Any, request_id: str, first_block: int, last_block: int) -> None:
        original(self, request_id, first_block - 1 if first_block < last_block else first_block, last_block)

    monkeypatch.setattr(RSWAManager, "_remove_blocks_in_range", remove)


@pytest.mark.parametrize("seed_bug", [gap_into_the_window, gap_into_the_prompt], ids=["window", "prompt"])
def test_a_gap_reaching_into_what_a_token_attends_is_caught(
    monkeypatch: pytest.MonkeyPatch, seed_bug: Callable[[pytest.MonkeyPatch], None]
) -> None:
    seed_bug(monkeypatch)
    failure = first_failure()
    assert failure.check == Check.ACCOUNTING and "is in the free queue" in str(failure), failure


def test_a_seeded_bug_is_found_by_a_run_and_its_trace_replays(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvfuzz run --model rswa`` finds the gap that reaches into the window, and its trace replays word for word."""
    gap_into_the_window(monkeypatch)
    trace = found_and_replayed(
        capsys, tmp_path / "corpus", ["--model", "rswa", "--num-blocks", "24"], {Check.ACCOUNTING}, "in the free queue"
    )
    assert trace.setup.model == "rswa"


def test_the_attention_check_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--scheduler", "vllm-v1", "--model", "rswa", "--attention", "gather", "--examples", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--model rswa takes no --attention" in line


SESSION_GAP = Path(__file__).parent.parent / "corpus" / "vllm-v1-scheduler-rswa-session-gap-a102da1e3f89.json"


def test_the_rswa_session_gap_replays_and_passes_with_the_gap_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM bug met by the first pinned R-SWA campaign (docs/findings.md): a streaming session decodes past its
    window, the manager frees the gap between its prompt and the window, and its next turn, whose prompt now holds
    those generated tokens, attends them through null table entries. It replays word for word; the same program
    passes when the manager frees no gap, and when the session is not resumed."""
    trace = load(SESSION_GAP)
    assert trace.known_bug and trace.known_bug.startswith("vLLM bug")
    replayed = replay(trace)
    assert replayed.reproduced and replayed.identical, replayed.describe_failure()
    assert "maps to vLLM's null block 0" in trace.failure.message
    unresumed = replay(attrs.evolve(trace, program=tuple(op for op in trace.program if op.to_json()["op"] != "resume")))
    assert not unresumed.failed, unresumed.describe_failure()
    monkeypatch.setattr(RSWAManager, "_remove_blocks_in_range", lambda *args: None)
    kept = replay(trace)
    assert not kept.failed, kept.describe_failure()
