"""A Mamba hybrid under vLLM's real v1 Scheduler (docs/scheduler-models.md#mamba-hybrid-models): a Jamba
with a Mamba layer beside a full-attention layer, a Mamba group and an attention group that vLLM's own planner
builds over one pool. The unmodified scheduler passes; a request's state block is read and written where vLLM's
runner reads and writes it; and each seeded bug of vLLM's ``MambaManager`` is caught, with its message.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core.single_type_kv_cache_manager import MambaManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm_versions import V1_RUNNER, v2_alone

from kvfuzz.cli import main
from kvfuzz.scheduler.async_batches import BatchQueue
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.fake_model import expected_output
from kvfuzz.scheduler.mamba_states import MambaStates
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.trace import load
from kvfuzz.scheduler.vllm_build import kv_cache_config

MAMBA = SchedulerSetup(num_blocks=16, model="mamba-hybrid", prefix_caching=False)
MAMBA_ARGS = ["--scheduler", "vllm-v1", "--model", "mamba-hybrid", "--no-prefix-caching", "--num-blocks", "16"]
ALIGN = SchedulerSetup(num_blocks=16, model="mamba-hybrid")  # prefix caching: vLLM's align mode


def test_vllm_plans_a_mamba_group_beside_an_attention_group_in_one_pool() -> None:
    config = kv_cache_config(MAMBA)
    assert config.num_blocks == MAMBA.num_blocks + 1  # the pool, and vLLM's null block
    specs = sorted(type(group.kv_cache_spec).__name__ for group in config.kv_cache_groups)
    assert specs == [FullAttentionSpec.__name__, MambaSpec.__name__]
    (mamba,) = [g.kv_cache_spec for g in config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]
    assert mamba.mamba_cache_mode == "none" and mamba.block_size == MAMBA.max_model_len
    session = Session(MAMBA)
    # without prefix caching (the only mode driven) vLLM runs its no-prefix-cache coordinator over both groups
    assert type(session.scheduler.kv_cache_manager.coordinator).__name__ == "KVCacheCoordinatorNoPrefixCache"
    assert len(session.worker.mamba.groups) == 1 and [rule.window for rule in session.worker.groups] == [None]
    # vLLM's startup check admits the longest request: 14 blocks of attention and two resident Mamba blocks
    assert MAMBA.max_model_len == 56


def test_with_prefix_caching_vllm_plans_the_mamba_group_in_align_mode() -> None:
    config = kv_cache_config(ALIGN)
    (mamba,) = [g.kv_cache_spec for g in config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]
    assert mamba.mamba_cache_mode == "align" and mamba.block_size == ALIGN.block_size
    session = Session(ALIGN)
    assert type(session.scheduler.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    assert type(session.worker.mamba).__name__ == "AlignModeStates"


def test_a_prefix_hit_restores_the_checkpoint_another_request_wrote() -> None:
    """Align mode: r0 prefills 8 tokens, leaving a checkpoint of its state at a block boundary; r1 shares those 8
    and more, hits the prefix cache, and resumes from r0's checkpoint of the hit prefix (the state check passes on
    it)."""
    session = Session(ALIGN)
    first = session.add([1, 2, 3, 0, 1, 2, 3, 0], 1)
    while first in session.outputs.unfinished():
        session.step()
    second = session.add([1, 2, 3, 0, 1, 2, 3, 0, 2, 2, 1], 2)
    session.step()
    state = session.worker.requests[second]
    (group,) = session.worker.mamba.groups
    hit = session.worker.computed[second]
    assert hit in (4, 8), session.worker.computed  # vLLM's choice of checkpoint: a whole block of the prefix
    source = state.tables[group][(hit - 1) // 4]
    assert all(block == 0 for block in state.tables[group][: (hit - 1) // 4]), state.tables  # interior states null
    restored = session.worker.mamba.states[(group, source)]
    assert (restored.request, restored.length) == (first, hit), restored  # r0's state of the prefix, read by r1
    while second in session.outputs.unfinished():
        session.step()
    assert session.outputs.requests[second].received == expected_output(second, 11, 2)


def test_the_unmodified_scheduler_passes_in_align_mode() -> None:
    outcome = search(ALIGN, examples=20, steps=30, shrink=False)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0 and outcome.hit_tokens > 0, outcome.describe()


def test_a_hit_that_hands_the_null_block_where_the_state_is_read_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded: the Mamba manager's prefix hit puts the cached checkpoint one entry early, leaving the null block in
    the entry the runner reads the restored state from."""
    original = MambaManager.find_longest_cache_hit.__func__  # type: ignore[attr-defined]

    def early(cls: Any, *args: Any, **kwargs: Any) -> Any:
        computed, length = original(cls, *args, **kwargs)
        for blocks in computed:
            if len(blocks) >= 2:
                blocks[-2], blocks[-1] = blocks[-1], blocks[-2]
        return computed, length

    monkeypatch.setattr(MambaManager, "find_longest_cache_hit", classmethod(early))
    outcome = search(ALIGN, examples=30, steps=30, shrink=False)
    assert outcome.failure is not None and outcome.failure.check.value == "content", outcome.explanation()
    assert re.search(
        r"its state block in Mamba group \d \(table entry \d+\) is vLLM's null block 0 \(table \[[0-9, ]+\]\), but "
        r"the step reads its state there",
        outcome.explanation(),
    ), outcome.explanation()


def test_a_chunked_request_reads_back_its_own_state_and_holds_one_state_block() -> None:
    """A prompt of 20 tokens under a budget of 16 is prefilled in two chunks: the second step reads the state the
    first wrote (16 tokens), and at the end its state block holds the state after all but its last token."""
    session = Session(MAMBA)
    request = session.add([1, 2, 3, 0] * 5, 4)
    (group,) = session.worker.mamba.groups
    lengths = []
    while request in session.outputs.unfinished():
        session.step()
        state = session.worker.requests.get(request)
        if state is not None:
            assert len(state.tables[group]) == 1 and state.tables[group][0] != 0, state.tables
            lengths.append(session.worker.mamba.states[(group, state.tables[group][0])].length)
    assert lengths[:2] == [16, 20] and lengths[-1] == 23, lengths
    assert session.outputs.requests[request].received == expected_output(request, 20, 4)
    session.drain()
    assert session.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == MAMBA.num_blocks


def test_the_unmodified_scheduler_passes_with_a_mamba_group() -> None:
    outcome = search(MAMBA, examples=20, steps=30, shrink=False)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0, outcome.describe()


def test_the_v1_model_runner_s_protocol_with_a_mamba_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the V1 model runner a preempted request resumes among the cached ones with a new state block."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    setup = SchedulerSetup(num_blocks=8, model="mamba-hybrid", prefix_caching=False)
    if not V1_RUNNER:  # vLLM 0.34.0 removed Model Runner V1: asking for it gets V2's protocol
        return v2_alone(setup)
    outcome = search(setup, examples=15, steps=30, shrink=False)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0, outcome.describe()


def _seed_first_allocation(monkeypatch: pytest.MonkeyPatch, seeded: Any) -> None:
    """Seed ``seeded(manager, request_id, blocks)`` into ``MambaManager.allocate_new_blocks`` for a request's first
    allocation (its state block); it returns the blocks handed out."""
    original = MambaManager.allocate_new_blocks

    def allocate(self: Any, request_id: str, num_tokens: int, num_tokens_main_model: int) -> Any:
        first = not self.req_to_blocks.get(request_id)
        blocks = original(self, request_id, num_tokens, num_tokens_main_model)
        return seeded(self, request_id, blocks) if first and blocks else blocks

    monkeypatch.setattr(MambaManager, "allocate_new_blocks", allocate)


def hands_out_the_null_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded: the Mamba manager hands a new request vLLM's null block as its state block (the real block it took
    goes back to the pool: the accounting stays consistent)."""

    def seeded(manager: Any, request_id: str, blocks: Any) -> Any:
        manager.block_pool.free_blocks([blocks[0]])
        null = manager.block_pool.null_block
        manager.req_to_blocks[request_id][-len(blocks)] = null
        return [null, *blocks[1:]]

    _seed_first_allocation(monkeypatch, seeded)


def test_the_state_check_catches_the_null_block_handed_out_as_a_state(monkeypatch: pytest.MonkeyPatch) -> None:
    hands_out_the_null_block(monkeypatch)
    outcome = search(MAMBA, examples=10, steps=20, shrink=False)
    assert outcome.failure is not None and outcome.failure.check.value == "content", outcome.explanation()
    assert re.search(
        r"its state block in Mamba group \d \(table entry 0\) is vLLM's null block 0 \(table \[0\]\), but the step "
        r"writes its state there",
        outcome.explanation(),
    ), outcome.explanation()


def test_accounting_catches_a_freed_state_block_still_in_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded: the Mamba manager frees a new request's state block back to the pool, yet keeps it in its table (the
    pool then hands it out again, to this request's attention table or another request's)."""

    def seeded(manager: Any, request_id: str, blocks: Any) -> Any:
        manager.block_pool.free_blocks([blocks[0]])
        return blocks

    _seed_first_allocation(monkeypatch, seeded)
    outcome = search(MAMBA, examples=10, steps=20, shrink=False)
    assert outcome.failure is not None and outcome.failure.check.value == "accounting", outcome.explanation()
    assert re.search(
        r"block \d+ is held by the tables of \d running request\(s\) \[[r0-9', ]+\] \(expected ref_cnt \d, not "
        r"free\), but the manager's block (is in the free queue|has ref_cnt \d)",
        outcome.explanation(),
    ), outcome.explanation()


def shares_a_live_state_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded: the Mamba manager hands a new request the state block of another live request (its ref_cnt taken,
    the block it took returned: the accounting stays consistent)."""

    def seeded(manager: Any, request_id: str, blocks: Any) -> Any:
        others = [held[0] for other, held in manager.req_to_blocks.items() if other != request_id and held]
        if not others or others[0].is_null:
            return blocks
        manager.block_pool.free_blocks([blocks[0]])
        others[0].ref_cnt += 1
        manager.req_to_blocks[request_id][-len(blocks)] = others[0]
        return [others[0], *blocks[1:]]

    _seed_first_allocation(monkeypatch, seeded)


def test_exclusive_states_catch_a_state_block_shared_by_two_live_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    shares_a_live_state_block(monkeypatch)
    outcome = search(MAMBA, examples=20, steps=30, shrink=False)
    assert outcome.failure is not None and outcome.failure.check.value == "exclusive", outcome.explanation()
    assert re.search(
        r"its Mamba state block \d+ \(group \d\) is also a block request r\d+ still holds: a state block belongs to "
        r"one request",
        outcome.explanation(),
    ), outcome.explanation()


def test_the_state_read_catches_a_shared_state_block_without_the_exclusive_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same seeded bug with the exclusive-state check switched off: the state check alone catches it when one
    of the two requests next reads its state and finds the other's."""
    shares_a_live_state_block(monkeypatch)
    monkeypatch.setattr(MambaStates, "check_exclusive", lambda *args: None)
    outcome = search(MAMBA, examples=20, steps=30, shrink=False)
    assert outcome.failure is not None and outcome.failure.check.value == "content", outcome.explanation()
    assert re.search(
        r"it resumes from \d+ computed tokens, so its state block \d+ in Mamba group \d should hold its own state "
        r"after them \(tag 0x[0-9a-f]+\), but holds the state of request r\d+ after \d+ tokens",
        outcome.explanation(),
    ), outcome.explanation()


def test_the_cli_option_the_trace_and_its_replay(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["run", *MAMBA_ARGS, "--speculative-tokens", "2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "kvfuzz: model mamba-hybrid is not driven with speculative decoding: vLLM 0.33.0 accepts the configuration, "
        "but its Jamba's Mamba1 mixer has no draft-verification state path (it ignores num_accepted_tokens), so there "
        "is no runner behaviour to model (docs/scheduler-models.md#mamba-hybrid-models)"
    ]
    assert main(["run", *MAMBA_ARGS, "--async-scheduling", "--examples", "3", "--json"]) == 0  # no longer refused
    assert json.loads(capsys.readouterr().out)["failed"] is False
    assert main(["run", *MAMBA_ARGS, "--examples", "3", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["failed"] is False and summary["steps"] > 0
    hands_out_the_null_block(monkeypatch)
    corpus = tmp_path / "corpus"
    assert main(["run", *MAMBA_ARGS, "--examples", "10", "--corpus", str(corpus)]) == 1
    out = capsys.readouterr().out
    assert "model mamba-hybrid: a two-layer Jamba" in out
    (path,) = corpus.glob("*.json")
    assert json.loads(path.read_text())["config"]["model"] == "mamba-hybrid"
    assert load(path).setup == MAMBA
    assert main(["replay", str(path)]) == 1  # reproduced
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["replay", str(path)]) == 0  # gone without the bug


# -- under async scheduling (docs/scheduler-models.md, "Mamba hybrid models under async scheduling") ------------------

ASYNC_MAMBA = SchedulerSetup(num_blocks=8, model="mamba-hybrid", prefix_caching=False, async_scheduling=True)
ASYNC_ALIGN = SchedulerSetup(num_blocks=8, model="mamba-hybrid", async_scheduling=True)


@pytest.mark.parametrize("setup", [ASYNC_MAMBA, ASYNC_ALIGN], ids=["none", "align"])
def test_the_unmodified_async_scheduler_passes_with_a_mamba_group_and_rewrites_released_state_blocks(
    setup: SchedulerSetup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two batches in flight: vLLM 0.33.0 hands a state block released while a step in flight reads it to the next
    step at once (relying on the stream's order, as for K/V blocks); the check counts those state rewrites, and the
    run reaches them, with preemptions (and hits in align mode)."""
    state_rewrites = []
    ordered = BatchQueue.state_ordered

    def counted(self: BatchQueue, reader: int, writer: int) -> bool:
        state_rewrites.append((reader, writer))
        return ordered(self, reader, writer)

    monkeypatch.setattr(BatchQueue, "state_ordered", counted)
    outcome = search(setup, examples=20, steps=30, shrink=False)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0 and state_rewrites and outcome.rewrites >= len(state_rewrites), outcome.describe()
    assert setup.prefix_caching is False or outcome.hit_tokens > 0, outcome.describe()


def test_released_catches_a_state_write_the_device_runs_before_the_in_flight_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded runner bug: the Mamba states are copied and updated on a side stream that does not wait for the steps in
    flight (K/V writes stay ordered). r0's prompt is launched (step 1 reads and writes its state block), r0 is aborted
    while step 1 is in flight, and step 2 writes r1's state into the block r0 released. Found from random requests and
    shrunk to that program; only the state blocks' coverage by the released check can see it."""
    monkeypatch.setattr(BatchQueue, "state_ordered", lambda self, reader, writer: False)
    outcome = search(ASYNC_MAMBA, examples=200, steps=30)
    assert outcome.check() == "released", outcome.describe()
    assert re.search(
        r"released check failed at step (\d+), request r\d+: step \1 writes request r\d+'s Mamba state \(after \d+ "
        r"token\(s\)\) into block \d+, which request\(s\) \['r\d+'(, 'r\d+')*\] released \(no table of theirs holds "
        r"it now\) while step (\d+), which reads it for them, is in flight \(its output not yet returned\), and the "
        r"device does not run step \1's writes after step \3's reads",
        outcome.explanation(),
    ), outcome.describe()
    assert outcome.program.count("state.step()") == 2 and "state.abort(" in outcome.program, outcome.program


def test_an_async_mamba_finding_is_saved_with_its_configuration_and_replays(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The seeded side-stream state write, found by ``kvfuzz run``: its trace records the model and async scheduling,
    and replays with the bug (reproduced) and without it (gone)."""
    monkeypatch.setattr(BatchQueue, "state_ordered", lambda self, reader, writer: False)
    corpus = tmp_path / "corpus"
    args = [*MAMBA_ARGS[:-1], "8", "--async-scheduling", "--examples", "200", "--corpus", str(corpus)]
    assert main(["run", *args]) == 1
    assert "writes request r1's Mamba state (after 1 token(s)) into block" in capsys.readouterr().out
    (path,) = corpus.glob("*.json")
    assert load(path).setup == ASYNC_MAMBA
    assert main(["replay", str(path)]) == 1
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["replay", str(path)]) == 0
