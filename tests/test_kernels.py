"""Invariant 2's pluggable attention kernels: gather (bitwise), FlexAttention over the paged pools (within a stated
tolerance), and the allocator's own; their choice carried through the CLI and traces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
from factories import make_allocator

from kvfuzz.allocator import paged_allocator
from kvfuzz.allocator.paged import PagedAllocator
from kvfuzz.engine import Engine, Invariant, InvariantViolation, MachineConfig
from kvfuzz.kernels import (
    FlexKernel,
    GatherKernel,
    KernelUnavailable,
    PagedBatch,
    Tolerance,
    compare,
    different_kernel_tolerance,
    make_kernel,
)
from kvfuzz.program.call import Call
from kvfuzz.program.replay import NotApplicable
from kvfuzz.reference.content import ModelShape
from kvfuzz.runner import run
from kvfuzz.saved.corpus import export_test, replay_trace
from kvfuzz.saved.trace import Trace, load, save
from kvfuzz.zoo import variant

DTYPES = [torch.float32, torch.bfloat16]


def config(kernel: str, dtype: torch.dtype = torch.float32, **kwargs) -> MachineConfig:
    return MachineConfig(
        block_size=4, num_blocks=12, num_host_blocks=4, shape=ModelShape(dtype=dtype), kernel=kernel, **kwargs
    )


def life_cycle(h: Engine) -> None:
    """Admit, grow across blocks, fork, free and reuse: tables that are neither contiguous nor in order."""
    assert h.admit("s0", (), (1, 2, 3, 4, 5, 6))
    assert h.admit("s1", (), (7, 8, 9))
    h.step()
    h.free("s0")
    assert h.admit("s2", (), tuple(range(20, 31)))
    assert h.fork("s1", "s3")
    h.step()
    assert h.grow("s3", (5, 6, 7)) and h.grow("s2", (9,))
    h.step()
    h.quiesce()


# -- the protocol's parts ----------------------------------------------------------------------------------------


def test_compare_is_bitwise_without_a_tolerance_and_elementwise_within_one() -> None:
    expected = torch.rand(3, 2, 4, 8)
    nudged = expected.clone()
    nudged[2, 1, 3, 5] = torch.nextafter(nudged[2, 1, 3, 5], torch.tensor(2.0))
    assert compare(expected.clone(), expected, None) is None
    assert compare(nudged, expected, None).row == 2
    assert compare(nudged, expected, Tolerance(1e-6, 0.0)) is None
    nudged[1, 0, 0, 0] += 1e-3
    mismatch = compare(nudged, expected, Tolerance(1e-5, 1e-5))
    assert mismatch.row == 1 and mismatch.max_abs_diff == pytest.approx(1e-3, rel=1e-3)
    nudged[0, 0, 0, 0] = float("nan")
    assert compare(nudged, expected, Tolerance(1.0, 1.0)).row == 0


def test_each_kernel_states_its_tolerance() -> None:
    assert GatherKernel().tolerance(torch.bfloat16) is None
    flex = FlexKernel()
    assert flex.tolerance(torch.float32).atol < flex.tolerance(torch.float16).atol < flex.tolerance(torch.bfloat16).atol
    with pytest.raises(ValueError, match="float64"):
        different_kernel_tolerance(torch.float64)


def test_unknown_kernels_and_an_allocator_without_attention_are_refused() -> None:
    allocator = paged_allocator(config("gather").pool_spec())
    with pytest.raises(KernelUnavailable, match="no attention kernel named 'triton'"):
        make_kernel("triton", allocator, ModelShape())
    with pytest.raises(KernelUnavailable, match="does not provide its own attention"):
        make_kernel("allocator", allocator, ModelShape())
    with pytest.raises(ValueError):
        MachineConfig(kernel="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_flex_reads_the_pool_in_place_and_agrees_with_gather(dtype: torch.dtype) -> None:
    """Scattered tables, a sliding-window start, GQA; a block nobody holds has large values that must not leak in."""
    shape = ModelShape(num_layers=2, num_kv_heads=2, num_query_heads=6, head_dim=8, dtype=dtype)
    size, blocks = 4, 10
    torch.manual_seed(0)
    keys = torch.rand(blocks * size, *shape.kv_row_shape).to(dtype)
    values = torch.rand(blocks * size, *shape.kv_row_shape).to(dtype)
    keys[8:12] = values[8:12] = 1000.0  # block 2: nobody's
    tables = [(7, 3, 9), (0,), (5, 1, 4, 6)]
    batch = PagedBatch(
        ("a", "b", "c"), tables, (0, 0, 6), (10, 3, 15), torch.rand(3, 2, 6, 8).to(dtype), keys, values, size
    )
    gathered = GatherKernel().attend(batch)
    flexed = FlexKernel().attend(batch)
    assert torch.isfinite(gathered).all() and torch.isfinite(flexed).all()
    assert compare(flexed, gathered, different_kernel_tolerance(dtype)) is None
    wrong = attrs.evolve(batch, tables=[(7, 3, 8 // size), (0,), (5, 1, 4, 6)])
    assert compare(FlexKernel().attend(wrong), gathered, different_kernel_tolerance(dtype)) is not None


def test_rows_of_groups_with_smaller_blocks_read_only_their_rows() -> None:
    """Pools of 8 rows per block; rows "a" and "c" hold 4 tokens per block (a KV-cache group of smaller blocks), so
    rows 4..7 of their blocks, full of large values, must never be read; row "b" holds 8 per block."""
    shape = ModelShape(num_layers=1, num_kv_heads=1, num_query_heads=2, head_dim=4)
    rows, blocks = 8, 6
    torch.manual_seed(0)
    keys = torch.rand(blocks * rows, *shape.kv_row_shape)
    values = torch.rand(blocks * rows, *shape.kv_row_shape)
    for block in (0, 2, 3, 5):  # the blocks of rows "a" and "c": their unused rows
        keys[block * rows + 4 : (block + 1) * rows] = values[block * rows + 4 : (block + 1) * rows] = 1000.0
    tables = [(3, 0), (1, 4), (5, 2)]
    queries = torch.rand(3, 1, 2, 4)
    batch = PagedBatch(("a", "b", "c"), tables, (0, 0, 2), (7, 13, 8), queries, keys, values, rows, (4, 8, 4))
    assert batch.slots(0) == [24, 25, 26, 27, 0, 1, 2]  # positions 0..6: block 3 rows 0..3, then block 0 rows 0..2
    assert batch.slots(1)[-5:] == [32, 33, 34, 35, 36]  # positions 8..12: block 4 rows 0..4
    gathered = GatherKernel().attend(batch)
    assert torch.isfinite(gathered).all() and gathered.abs().max() < 1
    assert compare(FlexKernel().attend(batch), gathered, different_kernel_tolerance(torch.float32)) is None


# -- in the machine ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", ["gather", "flex"])
def test_the_correct_allocator_passes_by_hand_under_each_kernel(kernel: str, dtype: torch.dtype) -> None:
    cfg = config(kernel, dtype)
    h = Engine(make_allocator(window=1)(cfg.pool_spec()), cfg)
    life_cycle(h)
    assert h.checks.attention.kernel.name == kernel


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_correct_allocator_passes_the_machine_under_flex(dtype: torch.dtype) -> None:
    summary = run(paged_allocator, config("flex", dtype), examples=12, steps=40)
    assert not summary.failed, summary.explanation
    assert summary.operations["step"] > 50


def test_flex_follows_a_sliding_window() -> None:
    def windowed(spec):
        return PagedAllocator(spec.block_size, spec.num_blocks, inflight_window=1, sliding_window=6)

    summary = run(windowed, config("flex"), examples=12, steps=40)
    assert not summary.failed, summary.explanation


def test_the_gather_kernel_s_reads_are_decided_by_their_tags_and_any_other_tag_goes_to_the_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under the gather kernel, a step whose every read slot records the reference's tag passes without gathering
    (the pools keep each recorded slot's K/V equal to its record's); a read slot whose record names another tag sends
    the check to the tensors, which decide as before."""
    gathers: list[int] = []
    gathered = GatherKernel.gathered
    monkeypatch.setattr(GatherKernel, "gathered", lambda kernel, batch: gathers.append(1) or gathered(kernel, batch))
    h = Engine(make_allocator(window=1)(config("gather").pool_spec()), config("gather"))
    life_cycle(h)
    assert h.checks.attention.kernel.name == "gather" and h.stats["step"] >= 3 and gathers == []
    assert h.admit("s4", (), (7, 8, 9, 10, 11))
    h.step()
    slot = h.expected.layout("s4").slot_of(h.expected.seqs["s4"].table, 0)
    record = h.pools.shadow[slot]
    assert not h.pools.made  # no step has read the tensors: they do not exist yet
    assert h.pools.keys.shape[0] > slot  # made now, from the records
    # a record changed behind the pools' back (not through a write) leaves the tensors as they are
    h.pools.shadow[slot] = attrs.evolve(record, tag=record.tag ^ 1)  # the tensors still hold the right K/V
    h.checks.attention.check()
    assert gathers == [1]  # the tags disagreed: the tensors were compared (and agreed)
    h.pools.keys[slot] += 1.0  # now the K/V the kernel reads differ too
    with pytest.raises(InvariantViolation) as caught:
        h.checks.attention.check()
    assert caught.value.invariant is Invariant.ATTENTION


def test_the_pools_tensors_are_made_only_when_read_and_their_bits_are_then_checked() -> None:
    """A passing example under the gather kernel never makes the pools' tensors; once something has read them, a
    row that differs from its record's K/V (written behind the pools' back) is invariant 1's, bit for bit."""
    h = Engine(make_allocator(window=1)(config("gather").pool_spec()), config("gather"))
    life_cycle(h)
    assert h.admit("s4", (), (7, 8, 9, 10, 11))
    h.step()
    assert not h.pools.made
    h.checks.content.holds((), [("s4", 0)])  # no tensors: the records are the whole content
    slot = h.expected.layout("s4").slot_of(h.expected.seqs["s4"].table, 0)
    h.pools.keys[slot] += 1.0  # made now from the records, then one row changed behind their back
    assert h.pools.made
    with pytest.raises(InvariantViolation) as caught:
        h.checks.content.holds((), [("s4", 0)])
    assert caught.value.invariant is Invariant.CONTENT and "values differ" in str(caught.value)


class WrongEntryKernel(FlexKernel):
    """A seeded kernel bug: reads every sequence's last logical block from the physical block before it."""

    def attend(self, batch: PagedBatch) -> torch.Tensor:
        num_blocks = batch.num_blocks
        tables = [table[:-1] + ((table[-1] - 1) % num_blocks,) for table in batch.tables]
        return super().attend(attrs.evolve(batch, tables=tables))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_kernel_reading_a_wrong_table_entry_breaks_invariant_2(dtype: torch.dtype) -> None:
    cfg = config("flex", dtype)
    h = Engine(make_allocator(window=1)(cfg.pool_spec()), cfg)
    h.checks.attention.kernel = WrongEntryKernel()
    with pytest.raises(InvariantViolation) as caught:
        life_cycle(h)
    assert caught.value.invariant is Invariant.ATTENTION
    explanation = caught.value.explain()
    assert "(flex kernel)" in explanation and "max abs difference" in explanation and "block table:" in explanation
    assert f"allowed: {different_kernel_tolerance(dtype)}" in explanation


@pytest.mark.parametrize("name", ["CopiesWrongBlock", "SwapInWrongHostBlock"])
def test_broken_zoo_allocators_are_still_caught_under_flex(name: str) -> None:
    broken = variant(name)
    summary = run(broken.factory(), MachineConfig(kernel="flex"), examples=300, steps=50)
    assert summary.failed and summary.violated in (Invariant.CONTENT, Invariant.ATTENTION)


# -- carried through the CLI and traces --------------------------------------------------------------------------


def test_a_trace_keeps_its_kernel_and_old_traces_mean_gather(tmp_path: Path) -> None:
    program = [Call("admit", {"namespace": (), "seq": "s0", "suffix": [0], "system": ()}), Call("step", {})]
    failure = {"invariant": 2, "title": "attention", "operation": "step()", "explanation": "x"}
    flex_path, _ = save(Trace("zoo:NoCopyOnWrite", MachineConfig(kernel="flex"), program, failure, 1), tmp_path)
    assert json.loads(flex_path.read_text())["config"]["kernel"] == "flex"
    assert load(flex_path).config.kernel == "flex"
    assert "kernel='flex'" in export_test(load(flex_path), str(flex_path))
    gather = Trace("zoo:NoCopyOnWrite", MachineConfig(), program, failure, 1)
    data = gather.to_json()
    assert "kernel" not in data["config"]  # unchanged format, unchanged digest
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert load(old).config.kernel == "gather"
    assert load(old).digest() == gather.digest()


def test_a_trace_run_under_the_allocator_kernel_does_not_fit_an_allocator_without_one() -> None:
    program = [Call("admit", {"namespace": (), "seq": "s0", "suffix": [0], "system": ()}), Call("step", {})]
    trace = Trace(
        "kvfuzz.adapters.torch_paged:paged_attention",
        MachineConfig(kernel="allocator"),
        program,
        {"invariant": 2, "title": "attention"},
        0,
    )
    assert not replay_trace(trace).failed
    with pytest.raises(NotApplicable, match="'allocator' attention kernel"):
        replay_trace(trace, "kvfuzz.allocator.paged:paged_allocator")


@pytest.mark.slow
def test_run_kernel_option(tmp_path: Path) -> None:
    def kvfuzz(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-W", "ignore", "-m", "kvfuzz.cli", "run", *args],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )

    refused = kvfuzz("--kernel", "allocator")
    assert refused.returncode == 2 and "does not provide its own attention" in refused.stderr
    flex = kvfuzz("--kernel", "flex", "--examples", "6", "--steps", "20")
    assert flex.returncode == 0, flex.stdout + flex.stderr
    assert "flex attention kernel" in flex.stdout
