"""vLLM's own write path and attention through the tables (kvfuzz.scheduler.write_paths, kvfuzz.scheduler.attention,
docs/scheduler.md): vLLM's worker-side block tables, kept from each SchedulerOutput as its model runner keeps them,
compute the slot mapping with vLLM's Triton kernel (Triton's interpreter) and agree with kvfuzz's tables on the
unmodified scheduler, under both model runners; each seeded bug below is caught by the new check and missed by
kvfuzz's own write path or with attention off.

Runs in the vLLM environment; this module chooses Triton's interpreter before anything imports vLLM (in one pytest
process it must be collected before any module that imports vLLM's scheduler, as .ci/run orders it)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs
import pytest
import torch

from kvfuzz.scheduler.write_paths import prepare_write_path

prepare_write_path("vllm")  # Triton's interpreter, before vLLM (and so Triton) is imported

from vllm.v1.worker.gpu.block_table import BlockTables  # noqa: E402
from vllm_versions import V1_RUNNER, v2_alone  # noqa: E402

from kvfuzz.kernels.base import PagedBatch  # noqa: E402
from kvfuzz.kernels.gather import GatherKernel  # noqa: E402
from kvfuzz.option_defaults import ATTENTION_NAMES, WRITE_PATH_NAMES  # noqa: E402
from kvfuzz.scheduler.attention import ATTENTIONS, KernelAttention  # noqa: E402
from kvfuzz.scheduler.config import SchedulerSetup  # noqa: E402
from kvfuzz.scheduler.recorder import FailureRecorder  # noqa: E402
from kvfuzz.scheduler.replay import replay  # noqa: E402
from kvfuzz.scheduler.search import search  # noqa: E402
from kvfuzz.scheduler.session import Session, WorkerFactory  # noqa: E402
from kvfuzz.scheduler.trace import load  # noqa: E402
from kvfuzz.scheduler.violations import Check, SchedulerViolation  # noqa: E402
from kvfuzz.scheduler.worker import Worker  # noqa: E402
from kvfuzz.scheduler.write_paths import (  # noqa: E402
    WRITE_PATHS,
    OwnSlotMapping,
    VllmV1BlockTable,
    VllmV2BlockTables,
    vllm_write_path,
)

SMALL = SchedulerSetup(num_blocks=8)  # a pool small enough that the scheduler preempts
PROMPT = [1, 2, 3, 0, 2]  # a block and one token: decoding appends a block at position 8


def vllm_worker(setup: SchedulerSetup) -> Worker:
    return Worker(setup, vllm_write_path, KernelAttention(GatherKernel(), setup.block_size))


def own_worker(setup: SchedulerSetup) -> Worker:
    return Worker(setup, OwnSlotMapping)


def run_one(worker: WorkerFactory, max_tokens: int = 8) -> Session:
    """A request alone, stepped until it has finished, then drained."""
    session = Session(SMALL, worker)
    request = session.add(PROMPT, max_tokens)
    while request in session.outputs.unfinished():
        session.step()
    session.drain()
    return session


def violation(action: Callable[[], object]) -> SchedulerViolation:
    with pytest.raises(SchedulerViolation) as caught:
        action()
    return caught.value


def test_the_names_the_command_line_and_traces_take_are_the_implemented_ones() -> None:
    assert tuple(WRITE_PATHS) == WRITE_PATH_NAMES and tuple(ATTENTIONS) == ATTENTION_NAMES


def test_vllm_s_v2_block_tables_agree_with_kvfuzz_s_on_the_unmodified_scheduler() -> None:
    assert isinstance(Worker(SMALL, vllm_write_path).write_path, VllmV2BlockTables)
    outcome = search(SMALL, examples=12, steps=30, worker=vllm_worker)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0 and outcome.hit_tokens > 0, outcome.describe()


def test_vllm_s_v1_block_table_agrees_under_the_v1_model_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    if not V1_RUNNER:  # vLLM 0.34.0 removed Model Runner V1: V2's protocol and block tables all the same
        return v2_alone(SMALL, vllm_write_path)
    assert isinstance(Worker(SMALL, vllm_write_path).write_path, VllmV1BlockTable)
    outcome = search(SMALL, examples=8, steps=30, worker=vllm_worker)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0, outcome.describe()


def test_an_off_by_one_append_in_v2_s_block_tables_is_a_slot_mapping_violation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded: ``BlockTables.append_block_ids`` appends a cached request's new blocks one entry early, over its last
    block. The scheduler's output is right, so kvfuzz's own write path never sees it."""
    original = BlockTables.append_block_ids

    def one_early(self: BlockTables, req_index: int, new_block_ids: tuple[list[int], ...], overwrite: bool) -> None:
        if not overwrite:
            self.num_blocks.np[0, req_index] -= 1
        original(self, req_index, new_block_ids, overwrite)

    monkeypatch.setattr(BlockTables, "append_block_ids", one_early)
    run_one(own_worker)  # kvfuzz's own slot mapping: passes
    found = violation(lambda: run_one(vllm_worker))
    assert found.check is Check.SLOT_MAPPING
    assert re.search(
        r"slot-mapping check failed at step \d+, request r0: its position 8 belongs in block \d+ \(table entry 2 of "
        r"\[\d+, \d+, \d+\]\), slot \d+, but the vllm slot mapping writes it to slot \d+ \(block \d+, offset 0\)",
        str(found),
    ), str(found)


def test_an_off_by_one_append_in_v1_s_block_table_is_a_slot_mapping_violation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same seeded bug in the V1 runner's ``BlockTable.append_row``."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    if not V1_RUNNER:  # no V1 block table to seed: V2's catches the same bug (the test above)
        return v2_alone(SMALL, vllm_write_path)
    from vllm.v1.worker.block_table import BlockTable

    original = BlockTable.append_row

    def one_early(self: Any, block_ids: list[int], row_idx: int) -> None:
        if block_ids and self.num_blocks_per_row[row_idx]:
            self.num_blocks_per_row[row_idx] -= 1
        original(self, block_ids, row_idx)

    monkeypatch.setattr(BlockTable, "append_row", one_early)
    run_one(own_worker)
    found = violation(lambda: run_one(vllm_worker))
    assert found.check is Check.SLOT_MAPPING and "its position 8 belongs in block" in str(found), str(found)


def test_a_slot_mapping_kernel_that_shifts_positions_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded: the slot mapping is computed for each token's previous position (an off-by-one in the positions
    handed to vLLM's kernel): every token after the first is written one slot early."""
    original = BlockTables.compute_slot_mappings

    def shifted(self: BlockTables, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None):  # type: ignore[no-untyped-def]
        return original(self, idx_mapping, query_start_loc, (positions - 1).clamp(min=0), num_tokens_padded, out)

    monkeypatch.setattr(BlockTables, "compute_slot_mappings", shifted)
    run_one(own_worker)
    found = violation(lambda: run_one(vllm_worker))
    assert found.check is Check.SLOT_MAPPING and found.step == 1, str(found)
    assert "its position 1 belongs in block" in str(found), str(found)


HYBRID = SchedulerSetup(num_blocks=12, model="sliding-window")  # two KV-cache groups over one pool


def test_vllm_s_block_tables_agree_per_group_with_a_hybrid_model() -> None:
    """vLLM's V2 ``BlockTables`` with one table per KV-cache group: each group's slot mapping is checked against the
    worker's table of that group, and attention computed through each group's table (the sliding-window group's
    within its window), on the unmodified scheduler, with preemptions and hits."""
    worker = Worker(HYBRID, vllm_write_path)
    assert isinstance(worker.write_path, VllmV2BlockTables) and worker.write_path.tables.num_kv_cache_groups == 2
    outcome = search(HYBRID, examples=8, steps=30, worker=vllm_worker)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0 and outcome.hit_tokens > 0, outcome.describe()


def test_vllm_s_v1_block_table_agrees_per_group_with_a_hybrid_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    if not V1_RUNNER:
        return v2_alone(HYBRID, vllm_write_path)
    worker = Worker(HYBRID, vllm_write_path)
    assert isinstance(worker.write_path, VllmV1BlockTable) and len(worker.write_path.table.block_tables) == 2
    outcome = search(HYBRID, examples=6, steps=30, worker=lambda setup: Worker(setup, vllm_write_path))
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0, outcome.describe()


def test_an_off_by_one_append_in_one_group_of_v2_s_block_tables_is_caught_in_that_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded: ``BlockTables.append_block_ids`` appends a cached request's new blocks one entry early in the
    full-attention group only (group 1 in 0.33.0's order). Group 0's slot mapping is right, so a check of one group's
    table (what the write path did before it read every group) misses it."""
    original = BlockTables.append_block_ids
    full = next(rule.index for rule in Worker(HYBRID).groups if rule.window is None)

    def one_early(self: BlockTables, req_index: int, new_block_ids: tuple[list[int], ...], overwrite: bool) -> None:
        if not overwrite and new_block_ids[full]:
            self.num_blocks.np[full, req_index] -= 1
        original(self, req_index, new_block_ids, overwrite)

    monkeypatch.setattr(BlockTables, "append_block_ids", one_early)
    session = Session(HYBRID, lambda setup: Worker(setup, vllm_write_path))
    request = session.add(PROMPT, 8)
    found = violation(lambda: [session.step() for _ in range(8)])
    assert found.check is Check.SLOT_MAPPING and found.request == request, str(found)
    assert re.search(
        rf"its position 8 belongs in block \d+ \(table entry 2 of \[\d+, \d+, \d+\] in group {full} \(full "
        rf"attention\)\), slot \d+, but the vllm slot mapping writes it to slot \d+ \(block \d+, offset 0\)",
        str(found),
    ), str(found)


class ShortContext(KernelAttention):
    """Seeded: attention reads one position fewer than the token's context (its own K/V left out)."""

    def context_length(self, position: int) -> int:
        return max(position, 1)


def test_an_attention_read_with_the_wrong_context_length_is_an_attention_violation() -> None:
    def short(setup: SchedulerSetup) -> Worker:
        return Worker(setup, OwnSlotMapping, ShortContext(GatherKernel(), setup.block_size))

    run_one(own_worker)  # attention off: the K/V is right, and the content check passes
    found = violation(lambda: run_one(short))
    assert found.check is Check.ATTENTION and found.step == 1, str(found)
    assert re.search(
        r"attention check failed at step 1, request r0: the attention of its position 1 through its table \[\d+, "
        r"\d+\] \(gather kernel, context length 1\) differs from the reference over its own 2 positions' K/V by up "
        r"to [0-9.e-]+ \(allowed: none, bit for bit\)",
        str(found),
    ), str(found)


class NoWindow(GatherKernel):
    """Seeded: a kernel that ignores the sliding window, attending every position from 0."""

    def attend(self, batch: PagedBatch) -> torch.Tensor:
        return super().attend(attrs.evolve(batch, starts=[0] * len(batch.starts)))


def test_attention_that_ignores_the_sliding_window_is_caught_in_the_window_s_group() -> None:
    """A request of 10 tokens under a window of 8: its prefill's positions 8 and 9 attend from positions 1 and 2 in
    the sliding-window group. A kernel reading from 0 there differs from the reference over the window."""

    def no_window(setup: SchedulerSetup) -> Worker:
        return Worker(setup, OwnSlotMapping, KernelAttention(NoWindow(), setup.block_size))

    def prefill(worker: WorkerFactory) -> None:
        session = Session(HYBRID, worker)
        session.add(PROMPT * 2, 2)
        session.step()

    prefill(vllm_worker)  # the right window: passes
    found = violation(lambda: prefill(no_window))
    sliding = next(rule.index for rule in Worker(HYBRID).groups if rule.window is not None)
    assert found.check is Check.ATTENTION and found.step == 1, str(found)
    assert re.search(
        rf"the attention of its position 8 through its table \[\d+, \d+, \d+\] in group {sliding} \(sliding window "
        rf"of 8 tokens\) \(gather kernel, from position 1\) differs from the reference over its own 8 positions' K/V",
        str(found),
    ), str(found)


def test_vllm_s_triton_attention_through_the_tables_agrees_and_catches_the_short_context() -> None:
    """The same check with vLLM's Triton unified attention (interpreted; about a CPU-second a step), within its
    stated tolerance: the unmodified run passes, the short context is caught at the first step."""
    from kvfuzz.kernels.vllm_triton import VllmTritonKernel
    from kvfuzz.scheduler.config import MODEL_SHAPE

    def triton(setup: SchedulerSetup) -> Worker:
        return Worker(setup, OwnSlotMapping, ATTENTIONS["vllm-triton"](setup.block_size))

    def short(setup: SchedulerSetup) -> Worker:
        return Worker(setup, OwnSlotMapping, ShortContext(VllmTritonKernel(MODEL_SHAPE), setup.block_size))

    run_one(triton, max_tokens=2)
    found = violation(lambda: run_one(short, max_tokens=2))
    assert found.check is Check.ATTENTION and found.step == 1, str(found)
    assert "(vllm-triton kernel, context length 1)" in str(found) and "allowed: atol 1e-05, rtol 1e-05" in str(found)


def test_the_command_line_runs_vllm_s_write_path_with_attention(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfuzz.cli import main

    status = main(["run", "--scheduler", "vllm-v1", "--write-path", "vllm", "--attention", "gather", "--examples", "3"])
    out = capsys.readouterr().out
    assert status == 0 and "write path vllm, attention gather" in out and "passed:" in out, out


def test_a_slot_mapping_failure_is_saved_with_its_write_path_and_replays(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The trace records the write path and attention check, and a replay uses them: with kvfuzz's own write path
    the failure would be gone."""
    original = BlockTables.append_block_ids

    def one_early(self: BlockTables, req_index: int, new_block_ids: tuple[list[int], ...], overwrite: bool) -> None:
        if not overwrite:
            self.num_blocks.np[0, req_index] -= 1
        original(self, req_index, new_block_ids, overwrite)

    monkeypatch.setattr(BlockTables, "append_block_ids", one_early)
    session = Session(SMALL, vllm_worker)
    recorder = FailureRecorder("vllm-v1", tmp_path)
    found = violation(lambda: [session.add(PROMPT, 8), *(session.step() for _ in range(20))])
    recorder(session, found)
    assert recorder.first is not None and recorder.first.error is None
    saved = json.loads(recorder.first.path.read_text())
    assert saved["engine"]["write_path"] == "vllm" and saved["engine"]["attention"] == "gather", saved["engine"]
    trace = load(recorder.first.path)
    assert (trace.write_path, trace.attention) == ("vllm", "gather")
    assert "write path vllm, attention gather" in trace.describe()[0]
    again = replay(trace)
    assert again.reproduced and again.identical, again.describe_failure()
    assert not replay(trace, worker=own_worker).failed  # the default worker would have lost it


# -- a Mamba hybrid (docs/scheduler-models.md#mamba-hybrid-models): vLLM's tables of its attention group ---------------

MAMBA = SchedulerSetup(num_blocks=10, model="mamba-hybrid", prefix_caching=False)
ALIGN = SchedulerSetup(num_blocks=10, model="mamba-hybrid")  # prefix caching: vLLM's align mode


def prefill_mamba(worker: WorkerFactory) -> None:
    """One request's prefill on the Mamba hybrid, in ``none`` mode."""
    session = Session(MAMBA, worker)
    session.add(PROMPT, 2)
    session.step()


@pytest.mark.parametrize("setup", [MAMBA, ALIGN], ids=["none", "align"])
def test_vllm_s_block_tables_map_the_attention_group_of_a_mamba_hybrid(setup: SchedulerSetup) -> None:
    """vLLM's V2 ``BlockTables`` kept from the attention group's ids (the Mamba group, first in 0.33.0's order, holds
    state blocks, which the state path reads and writes): its slot mapping agrees with the worker's attention table,
    and attention through it with the reference, on the unmodified scheduler, with preemptions (and hits)."""
    worker = Worker(setup, vllm_write_path)
    assert [rule.index for rule in worker.groups] == [1] and worker.mamba.groups == (0,)
    assert isinstance(worker.write_path, VllmV2BlockTables) and worker.write_path.tables.num_kv_cache_groups == 1
    outcome = search(setup, examples=8, steps=30, worker=vllm_worker)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0 and (not setup.prefix_caching or outcome.hit_tokens > 0), outcome.describe()


def test_vllm_s_v1_block_table_maps_the_attention_group_of_a_mamba_hybrid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    if not V1_RUNNER:
        return v2_alone(MAMBA, vllm_write_path)
    worker = Worker(MAMBA, vllm_write_path)
    assert isinstance(worker.write_path, VllmV1BlockTable) and len(worker.write_path.table.block_tables) == 1
    outcome = search(MAMBA, examples=6, steps=30, worker=vllm_worker)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.preemptions > 0, outcome.describe()


def test_vllm_s_tables_kept_from_the_mamba_group_s_ids_are_a_slot_mapping_violation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded runner bug: vLLM's block tables are kept from the first KV-cache group's ids (the Mamba group's state
    block) where the attention group's belong, as a write path that reads one group's table would. kvfuzz's own write
    path passes; vLLM's writes position 0 into the state block."""
    from kvfuzz.scheduler import write_paths

    def first_group_s(block_ids: Sequence[Sequence[int]], groups: Sequence[int]) -> tuple[list[int], ...]:
        return tuple(list(block_ids[0]) for _ in groups)

    monkeypatch.setattr(write_paths, "attention_ids", first_group_s)

    prefill_mamba(own_worker)
    found = violation(lambda: prefill_mamba(vllm_worker))
    assert found.check is Check.SLOT_MAPPING and found.step == 1, str(found)
    assert re.search(
        r"slot-mapping check failed at step 1, request r0: its position 0 belongs in block (\d+) \(table entry 0 of "
        r"\[\1, \d+\] in group 1 \(full attention\)\), slot \d+, but the vllm slot mapping writes it to slot \d+ "
        r"\(block \d+, offset 0\)",
        str(found),
    ), str(found)


def test_attention_through_a_mamba_hybrid_s_attention_table_catches_the_short_context() -> None:
    def short(setup: SchedulerSetup) -> Worker:
        return Worker(setup, vllm_write_path, ShortContext(GatherKernel(), setup.block_size))

    prefill_mamba(vllm_worker)
    found = violation(lambda: prefill_mamba(short))
    assert found.check is Check.ATTENTION and found.step == 1, str(found)
    assert re.search(
        r"the attention of its position 1 through its table \[\d+, \d+\] in group 1 \(full attention\) \(gather "
        r"kernel, context length 1\) differs from the reference over its own 2 positions' K/V",
        str(found),
    ), str(found)


def test_the_command_line_runs_a_mamba_hybrid_with_vllm_s_write_path_and_attention(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvfuzz.cli import main

    args = ["run", "--scheduler", "vllm-v1", "--model", "mamba-hybrid", "--write-path", "vllm", "--attention", "gather"]
    status = main([*args, "--examples", "3"])
    out = capsys.readouterr().out
    assert status == 0 and "write path vllm, attention gather" in out and "model mamba-hybrid" in out, out
