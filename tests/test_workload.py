"""Workload replay: the trace format, the continuous-batching scheduler, its report, sweeps and plots."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import attrs
import pytest
from factories import CopyTailOnFork, declaring, make_allocator

from kvfuzz.allocator.paged import PagedAllocator, paged_allocator, synchronous_allocator
from kvfuzz.cli import main
from kvfuzz.engine.config import MachineConfig
from kvfuzz.workload import WorkloadError
from kvfuzz.workload.constructed import GENERATORS, constructed, constructed_json
from kvfuzz.workload.format import FORMAT, load_workload, parse_workload
from kvfuzz.workload.report import percentile
from kvfuzz.workload.scheduler import ReplayError, Scheduler, replay_workload
from kvfuzz.zoo import variant
from kvfuzz.zoo.variants import MatchableAtAllocation

SHIPPED = Path(__file__).resolve().parent.parent / "workloads" / "constructed"


def _config(block_size: int = 16, num_blocks: int = 48) -> MachineConfig:
    return MachineConfig(block_size=block_size, num_blocks=num_blocks, num_host_blocks=0)


def _replay(workload, factory=paged_allocator, config=None, **options):
    config = config or _config()
    allocator = factory(config.pool_spec())
    return replay_workload(workload, allocator, config, "under test", **options), allocator


def _workload(requests, groups=None):
    return parse_workload(
        {"format": FORMAT, "name": "test", "origin": "constructed", "prefix_groups": groups or {}, "requests": requests}
    )


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_constructed_workloads_drain_and_leave_every_block_free(name):
    report, allocator = _replay(constructed(name))
    assert not report.failed, report.failure
    assert report.quiescent
    assert report.finished + report.cancelled + report.rejected == report.requests
    assert sorted(allocator.free_blocks()) == list(range(48)) and not allocator.cached_blocks()
    assert report.occupancy.samples == report.steps
    for sample in report.occupancy.series:
        assert sample.referenced_blocks + sample.cached_blocks + sample.free_blocks + sample.pending_blocks == 48


def test_shared_system_prompt_is_shared_forked_and_copied_on_write():
    report, _ = _replay(constructed("shared-system-prompt"))
    assert report.operations["fork"] == 9  # every fourth of 36 requests asks for two samples
    assert report.operations["copy-on-write copies"] > 0
    assert report.operations["cache hits"] > 0
    assert report.occupancy.peak.saved_by_sharing > 0


def test_a_small_pool_preempts_and_keeps_its_refusals():
    report, _ = _replay(constructed("uniform"), config=_config(num_blocks=24))
    assert not report.failed, report.failure
    assert report.preemptions > 0 and report.refusals
    assert report.finished == report.requests
    first = report.refusals[0]
    assert first.blocks_needed >= 1 and first.free_blocks is not None and "refused" in first.describe()


def test_cancellation_is_counted_where_it_lands():
    workload = _workload(
        [
            {"id": "hog", "arrival": 0, "prompt_len": 12, "output_len": 4},
            {"id": "on-arrival", "arrival": 0, "prompt_len": 3, "output_len": 5, "cancel_at": 0},
            {"id": "queued", "arrival": 1, "prompt_len": 8, "output_len": 2, "cancel_at": 3},
        ]
    )
    report, _ = _replay(workload, factory=synchronous_allocator, config=_config(block_size=4, num_blocks=4))
    # on-arrival is admitted, then aborted before its first step; queued never finds room before its cancel.
    assert (report.cancelled, report.cancelled_before_admission, report.finished) == (2, 1, 1)
    assert report.admitted == 2 and report.quiescent


def test_latency_in_steps_without_contention():
    report, _ = _replay(_workload([{"id": "solo", "arrival": 3, "prompt_len": 6, "output_len": 5}]))
    assert report.time_to_first_token.p50 == 1  # admitted on arrival, prefilled in that step
    assert report.time_per_output_token.p50 == 1  # then one token per step
    assert report.steps == 3 + 5


def test_a_request_that_can_never_fit_is_rejected_not_spun_on():
    workload = _workload(
        [
            {"id": "huge", "arrival": 0, "prompt_len": 200, "output_len": 2},
            {"id": "small", "arrival": 0, "prompt_len": 4, "output_len": 2},
        ]
    )
    report, _ = _replay(workload, factory=synchronous_allocator, config=_config(block_size=4, num_blocks=8))
    assert report.rejected == 1 and report.finished == 1
    assert report.refusals[0].request == "huge"


@pytest.mark.parametrize("window", [0, 1, 3])
def test_a_request_that_outgrows_the_pool_alone_is_rejected_not_preempted_forever(window):
    """Its prompt fits, its output does not: alone in the pool, its grow is refused. Before, it preempted itself,
    was readmitted and refused again, for ever (49,991 preemptions in 100,000 steps, then reported as a crash):
    a readmission is not a refusal, so the never-fits rule never fired."""
    workload = _workload(
        [
            {"id": "big", "arrival": 0, "prompt_len": 4, "output_len": 20},
            {"id": "small", "arrival": 1, "prompt_len": 2, "output_len": 2},
        ]
    )
    config = _config(block_size=4, num_blocks=2)
    scheduler = Scheduler(
        workload, make_allocator(window=window)(config.pool_spec()), config, "under test", max_steps=500
    )
    report = scheduler.run()
    assert not report.failed, report.failure
    assert report.rejected == 1 and report.finished == 1 and report.quiescent
    assert [t.request.id for t in scheduler.tracked if t.phase.name == "REJECTED"] == ["big"]
    assert report.preemptions == 0  # alone, it is never its own victim: it waits, then is rejected
    assert report.steps < 10 + 3 * window


def test_a_request_is_not_rejected_while_released_blocks_are_still_in_flight():
    """W = 3: the first request's blocks, released after step 0, come back only once step 2 has completed, which
    is when step 5 is launched. Before, the second request was rejected after W + 2 refusals, at step 5, though the
    pool would hold it one round later."""
    workload = _workload(
        [
            {"id": "first", "arrival": 0, "prompt_len": 7, "output_len": 1},
            {"id": "second", "arrival": 1, "prompt_len": 2, "output_len": 4},
        ]
    )
    report, _ = _replay(workload, factory=make_allocator(window=3), config=_config(block_size=4, num_blocks=2))
    assert not report.failed, report.failure
    assert report.rejected == 0 and report.finished == 2


def _fcfs_no_fork(spec):
    return declaring(PagedAllocator, preempt_scheduled=False, fork=False)(spec)


@pytest.mark.parametrize(
    "factory",
    [make_allocator(window=0), make_allocator(window=1), make_allocator(window=3), _fcfs_no_fork],
    ids=["W=0", "W=1", "W=3", "FCFS without fork"],
)
def test_tiny_pools_drain_and_reject_only_requests_that_cannot_fit_alone(factory):
    """Random small workloads on pools of 1 to 12 blocks: every replay drains, and a request is rejected only if
    its samples, each holding its whole sequence, need more blocks than the pool has."""
    generator = random.Random(14)
    for _ in range(25):
        block_size, num_blocks = generator.choice([1, 2, 4, 8]), generator.randint(1, 12)
        requests = []
        for number in range(generator.randint(1, 5)):
            request = {
                "id": f"r{number}",
                "arrival": generator.randint(0, 5),
                "prompt_len": generator.randint(1, 20),
                "output_len": generator.randint(1, 20),
                "samples": generator.choice([1, 1, 1, 2, 3]),
            }
            if generator.random() < 0.2:
                request["cancel_at"] = request["arrival"] + generator.randint(0, 10)
            requests.append(request)
        config = _config(block_size=block_size, num_blocks=num_blocks)
        scheduler = Scheduler(_workload(requests), factory(config.pool_spec()), config, "under test", max_steps=3000)
        report = scheduler.run()
        assert not report.failed, (requests, config, report.failure)
        for tracked in scheduler.tracked:
            request = tracked.request
            fits_alone = request.samples * math.ceil((len(request.prompt) + request.output_len) / block_size)
            assert tracked.phase.name != "REJECTED" or fits_alone > num_blocks, (request, config, requests)


def test_a_broken_allocator_fails_the_replay_with_an_explanation():
    report, _ = _replay(constructed("heavy-cancellation"), factory=variant("LeakOnCancel").factory())
    assert report.failed
    assert "invariant" in report.failure


def test_shipped_constructed_files_match_their_generators():
    for name in GENERATORS:
        path = SHIPPED / f"{name}.json"
        assert json.loads(path.read_text()) == constructed_json(name), f"regenerate {path}"
        assert load_workload(path).origin == "constructed"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"requests": [{"arrival": 0, "prompt_len": 3}]}, "non-empty string 'id'"),
        ({"requests": [{"id": "a", "arrival": 0, "prompt_len": 3, "prompt": [1]}]}, "exactly one of"),
        ({"requests": [{"id": "a", "arrival": 0, "prompt_len": 3, "prefix_group": "sys"}]}, "'sys' is not defined"),
        ({"requests": [{"id": "a", "arrival": -1, "prompt_len": 3}]}, "'arrival' must be an integer >= 0"),
        ({"requests": [{"id": "a", "arrival": 0, "prompt_len": 3, "output_len": 1}] * 2}, "appears twice"),
        ({"origin": "somewhere"}, "'origin' must be one of"),
    ],
)
def test_bad_workloads_are_refused_with_the_request_named(change, message):
    data = {
        "format": FORMAT,
        "name": "bad",
        "origin": "recorded",
        "requests": [{"id": "a", "arrival": 0, "prompt_len": 3, "output_len": 1}],
        **change,
    }
    with pytest.raises(WorkloadError, match=message):
        parse_workload(data)


def test_percentile_is_nearest_rank():
    assert percentile(list(range(1, 101)), 50) == 50 and percentile(list(range(1, 101)), 99) == 99
    assert percentile([7], 99) == 7 and percentile([], 50) is None


def test_replay_workload_command_sweeps_block_sizes_side_by_side(capsys, tmp_path):
    plot = tmp_path / "occupancy.png"
    assert (
        main(
            ["replay-workload", "constructed:shared-system-prompt", "--block-sizes", "8,16,32,64", "--plot", str(plot)]
        )
        == 0
    )
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("pool positions"))
    assert row.split()[-4:] == ["768", "768", "768", "768"]
    assert next(line for line in out.splitlines() if line.startswith("invariants")).split()[-4:] == ["held"] * 4
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_replay_workload_command_json_and_errors(capsys, tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps(constructed_json("uniform")))
    assert main(["replay-workload", str(path), "--json", "--num-blocks", "40"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"] == "uniform" and report["num_blocks"] == 40 and report["quiescent"]
    assert main(["replay-workload", "constructed:nope"]) == 2
    assert "no constructed workload named 'nope'" in capsys.readouterr().err
    assert main(["replay-workload", "constructed:heavy-cancellation", "--allocator", "zoo:LeakOnCancel"]) == 1
    assert "invariant 4 (free set)" in capsys.readouterr().out
    assert main(["replay-workload", "constructed:uniform", "--block-sizes", "16,48", "--pool-positions", "100"]) == 2
    assert "not a multiple of block size(s) [16, 48]" in capsys.readouterr().err


def _registers_when_scheduled(spec):
    """kvfuzz's zoo allocator that registers blocks at allocation, declared as vLLM declares it (FCFS, no fork)."""
    allocator = MatchableAtAllocation(spec.block_size, spec.num_blocks, inflight_window=0)
    allocator.capabilities = attrs.evolve(
        allocator.capabilities,
        hits_scheduled_writes=True,
        shares_scheduled_blocks=True,
        free_lands_scheduled_writes=True,
        preempt_scheduled=False,
        fork=False,
        rollback=False,
    )
    return allocator


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_an_fcfs_engine_preempts_only_unscheduled_requests(name):
    """Under pressure, samples admitted side by side and early registration: victims never have work scheduled
    this round, so no registered block is left unwritten."""
    report, _ = _replay(constructed(name), factory=_registers_when_scheduled, config=_config(num_blocks=20))
    assert not report.failed, report.failure
    assert report.quiescent


def test_an_fcfs_engine_never_picks_a_victim_with_work_scheduled_this_round():
    workload = _workload(
        [
            {"id": "a", "arrival": 0, "prompt_len": 5, "output_len": 4},
            {"id": "b", "arrival": 0, "prompt_len": 5, "output_len": 4},
        ]
    )
    config = _config(block_size=4, num_blocks=8)
    for factory, expected in ((_registers_when_scheduled, ["a"]), (paged_allocator, ["b", "a"])):
        scheduler = Scheduler(workload, factory(config.pool_spec()), config, "under test")
        scheduler.waiting = list(scheduler.tracked)
        scheduler._admit()
        scheduler._run_step()
        scheduler.scheduled.add("b")  # b's next token is already scheduled this round
        assert [tracked.request.id for tracked in scheduler.victims()] == expected


def _copies_tail_on_fork(spec):
    return declaring(CopyTailOnFork, fork_copies=True)(spec)


@pytest.mark.parametrize(
    "factory",
    [paged_allocator, _registers_when_scheduled, _copies_tail_on_fork],
    ids=["sharing fork", "samples admitted beside", "copying fork"],
)
def test_parallel_samples_drain_even_with_one_token_each_and_a_tight_pool(factory):
    workload = _workload(
        [
            {"id": "a", "arrival": 0, "prompt_len": 5, "output_len": 1, "samples": 2},
            {"id": "p1", "arrival": 0, "prompt_len": 5, "output_len": 3, "samples": 2},
            {"id": "p2", "arrival": 0, "prompt_len": 5, "output_len": 3, "samples": 2},
        ]
    )
    report, _ = _replay(workload, factory=factory, config=_config(block_size=4, num_blocks=4))
    assert not report.failed, report.failure
    assert report.finished == 3 and report.quiescent


def test_a_partly_admitted_request_keeps_its_scheduled_branches():
    """With samples admitted beside the prompt, a refused branch does not undo (withdraw) the ones already
    scheduled: their blocks are registered for the writes of the next step."""
    workload = _workload(
        [
            {"id": "hog", "arrival": 0, "prompt_len": 4, "output_len": 6},
            {"id": "a", "arrival": 1, "prompt": [1, 2, 3, 4, 5, 6], "output_len": 2, "samples": 3},
        ]
    )
    report, _ = _replay(workload, factory=_registers_when_scheduled, config=_config(block_size=4, num_blocks=4))
    assert not report.failed, report.failure
    assert report.finished == 2 and report.refusals


def test_request_ids_may_not_name_a_sample():
    with pytest.raises(WorkloadError, match="may not contain '/'"):
        _workload([{"id": "a/1", "arrival": 0, "prompt_len": 5, "output_len": 1}])


def test_an_allocator_crash_ends_the_replay_with_a_report():
    class Crashes:
        def __init__(self, spec):
            self.inner = paged_allocator(spec)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def grow(self, seq, tokens):
            raise RuntimeError("boom")

    report, _ = _replay(constructed("uniform"), factory=Crashes)
    assert report.failed and report.failure.startswith("crash (RuntimeError) during grow(")


def test_an_allocator_whose_loads_make_requests_wait_is_refused_before_any_work():
    """Workload replay does not model a request waiting for its asynchronous loads: such an allocator is refused with
    one line instead of stalling the workload."""
    from test_async_loads import AsyncHostTierAllocator

    config = _config(block_size=4, num_blocks=8)
    config = attrs.evolve(config, num_host_blocks=4)
    workload = _workload([{"id": "a", "arrival": 0, "prompt_len": 4, "output_len": 2}])
    with pytest.raises(ReplayError, match="declares async_loads: workload replay does not yet model"):
        Scheduler(workload, AsyncHostTierAllocator(config.pool_spec()), config, "async host tier")
