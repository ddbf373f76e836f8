"""Shrinking a scheduler failure by deleting operations (kvfuzz/scheduler/shrinking.py over the deletion pass
every target shares, kvfuzz/shrink/deletion.py, and the scheduler program's view of it, kvfuzz/scheduler/deletions.py),
on a fake engine whose one bug is known exactly: aborting a request that asked for 7 tokens fails, once a step has
run (before any step the same abort fails otherwise: another signature, which shrinking must not take)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import attrs

from kvfuzz.campaign.scheduler.guided import Guidance
from kvfuzz.campaign.scheduler.loop import BatchPlan, BatchResult, SchedulerCampaignOptions, run_batch
from kvfuzz.campaign.scheduler.target import SchedulerTarget
from kvfuzz.coverage.scope import Scope
from kvfuzz.program.safeguards import Journal
from kvfuzz.scheduler import shrinking
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.deletions import SchedulerDeletions, dropping
from kvfuzz.scheduler.machine import Witness
from kvfuzz.scheduler.program import Abort, AddRequest, Operation, ResetPrefixCache, Resume, Step
from kvfuzz.scheduler.recorder import save_scheduler_trace
from kvfuzz.scheduler.replay import ReplayRefused, SchedulerReplay
from kvfuzz.scheduler.search import Outcome
from kvfuzz.scheduler.signature import scheduler_signature
from kvfuzz.scheduler.swarm import SwarmConfig
from kvfuzz.scheduler.trace import RecordedFailure, SchedulerTrace, load
from kvfuzz.shrink.signature import Signature
from kvfuzz.trace_saving import SavedTrace

SETUP = SchedulerSetup(num_blocks=16, block_size=4, max_num_batched_tokens=64, max_num_seqs=4, prefix_caching=True)


def _the_bug(request: str) -> None:
    """The fake engine's bug: every failure of the finding's signature is raised here (its frame is the signature's)."""
    raise ValueError(f"aborting {request}, which asked for 7 tokens, broke the fake engine")


def fake_replay(trace: SchedulerTrace, call_timeout: Optional[float] = None) -> SchedulerReplay:
    """Runs ``trace``'s program on the fake engine (see the module)."""
    sevens: set[str] = set()
    added = steps = 0
    for index, operation in enumerate(trace.program):
        if isinstance(operation, AddRequest):
            if operation.max_tokens == 7:
                sevens.add(f"r{added}")
            added += 1
        elif isinstance(operation, Step):
            steps += 1
        elif isinstance(operation, Abort) and operation.request in sevens:
            try:
                if not steps:
                    raise KeyError("an abort before any step")
                _the_bug(operation.request)
            except Exception as error:  # noqa: BLE001 -- the fake engine's failure, as a replay records it
                return SchedulerReplay(trace, RecordedFailure.of(error), index, error)
    return SchedulerReplay(trace, None, None)


NOISY: tuple[Operation, ...] = (
    AddRequest([1, 2, 3], 2),
    Step(),
    AddRequest([0, 1], 3),
    AddRequest([2], 1),
    Abort("r0"),
    Step(),
    AddRequest([3, 2, 1, 0], 7),  # r3: the request the bug needs
    Step(),
    AddRequest([3], 2),
    Abort("r1"),
    Step(),
    AddRequest([1, 1], 4),
    Step(),
    Abort("r3"),  # the abort that fails
    Step(),
    AddRequest([0], 1),
)
"""A failing program full of operations the failure does not need (its request is the fourth added)."""


def _trace(program: tuple[Operation, ...]) -> SchedulerTrace:
    replayed = fake_replay(SchedulerTrace("vllm-v1", SETUP, "V2", "0.33.0", program, _placeholder(), False))
    assert replayed.error is not None and replayed.failure is not None
    return SchedulerTrace("vllm-v1", SETUP, "V2", "0.33.0", program, replayed.failure, False)


def _placeholder() -> RecordedFailure:
    return RecordedFailure("crash", "(not run yet)", "NoFailure")


def _signature(trace: SchedulerTrace) -> Signature:
    error = fake_replay(trace).error
    assert error is not None
    return scheduler_signature("vllm-v1", error)


def test_dropping_an_addition_renames_the_later_requests_and_drops_what_names_it() -> None:
    program = [
        AddRequest([1], 1),
        AddRequest([2], 1, resumable=True),
        Abort("r0"),
        AddRequest([3], 1),
        Resume("r1", [4], 1),
        Abort("r2"),
        ResetPrefixCache(),
    ]
    assert dropping(program, {0}) == [
        AddRequest([2], 1, resumable=True),
        AddRequest([3], 1),
        Resume("r0", [4], 1),
        Abort("r1"),
        ResetPrefixCache(),
    ]
    assert dropping(program, {1, 6}) == [AddRequest([1], 1), Abort("r0"), AddRequest([3], 1), Abort("r1")]
    assert dropping(program, set()) == program


def test_a_request_s_operations_go_together_the_last_request_first() -> None:
    program = [AddRequest([1], 1), AddRequest([2], 1), Abort("r0"), Step(), Abort("r1")]
    deletions = SchedulerDeletions(lambda candidate: False)
    assert deletions.names(program) == ["r1", "r0"]
    assert deletions.without_name(program, "r0") == [AddRequest([2], 1), Step(), Abort("r0")]
    assert deletions.without_name(program, "r1") == [AddRequest([1], 1), Abort("r0"), Step()]
    assert deletions.without_name(program, "r2") == program
    assert deletions.without(program, 0, 2) == [Step()]


def test_a_failure_shrinks_to_the_operations_it_needs_under_its_own_signature() -> None:
    """The abort's request is renamed as the requests before it go; the step stays, since without it the abort
    fails with another signature (a KeyError), which is another finding, not this one."""
    trace = _trace(NOISY)
    shrunk = shrinking.shrink_trace(trace, _signature(trace), fake_replay)
    assert shrunk.trace.program == (AddRequest([3, 2, 1, 0], 7), Step(), Abort("r0"))
    assert shrunk.trace.shrunk and shrunk.stopped is None and shrunk.replays > 0
    assert isinstance(shrunk.error, ValueError) and "aborting r0" in str(shrunk.error)
    assert shrunk.trace.failure == RecordedFailure.of(shrunk.error)
    assert _signature(shrunk.trace) == _signature(trace)
    assert "from 16 operations to 3" in shrunk.describe(len(NOISY))


def test_a_shrink_out_of_time_keeps_the_trace_it_was_given() -> None:
    trace = _trace(NOISY)
    shrunk = shrinking.shrink_trace(trace, _signature(trace), fake_replay, deadline=time.monotonic() - 1)
    assert shrunk.trace is trace and shrunk.error is None and shrunk.replays == 0
    assert shrunk.stopped is not None and "no operation of its 16 could be deleted" in shrunk.describe(16)


def test_a_minimal_trace_is_kept_as_it_is() -> None:
    minimal = (AddRequest([3], 7), Step(), Abort("r0"))
    trace = _trace(minimal)
    shrunk = shrinking.shrink_trace(trace, _signature(trace), fake_replay)
    assert shrunk.trace is trace and shrunk.error is None and shrunk.stopped is None


# -- a guided campaign's mutant that fails: shrunk, saved, the one found removed, confirmed --------------------------


def _guidance(tmp_path: Path, replay: Callable[..., SchedulerReplay], shrink: bool = True) -> Guidance:
    target = SchedulerTarget("vllm-v1", lambda setup, runner: None, _no_search, replay, scope=lambda: Scope(()))
    options = SchedulerCampaignOptions("vllm-v1", 1, tmp_path / "corpus", coverage=True, guided=True, shrink=shrink)
    return Guidance(target, options, Scope(()), tmp_path / "state", 0)


def _no_search(*args: object) -> Outcome:
    raise AssertionError("a mutant's failure is not searched again")


def _mutant_failed(guide: Guidance) -> tuple[BatchResult, Path]:
    trace = attrs.evolve(_trace(NOISY), failure=_placeholder())
    error = fake_replay(trace).error
    assert error is not None
    plan = BatchPlan.of(0, SwarmConfig(SETUP, "V2", 20, 0), 1, 5, None, None)
    result = guide._failed(plan, trace, error, 1, 6, time.perf_counter(), lambda signature, first: True)
    return result, guide.options.corpus


def test_a_mutant_s_new_failure_is_shrunk_saved_and_confirmed(tmp_path: Path) -> None:
    result, corpus = _mutant_failed(_guidance(tmp_path, fake_replay))
    assert (
        result.new
        and result.saved is not None
        and result.saved.trace.program
        == (
            AddRequest([3, 2, 1, 0], 7),
            Step(),
            Abort("r0"),
        )
    )
    assert result.reproduced == 1
    assert "shrunk by deleting operations, from 16 operations to 3" in result.note
    assert sorted(corpus.glob("*.json")) == [result.saved.path]
    outcome = result.outcome
    assert "aborting r0" in str(outcome.failure) and outcome.program.splitlines()[-2:] == [
        "state.abort('r0')",
        "state.drain()",
    ]


def test_no_shrink_keeps_a_mutant_s_trace_as_found(tmp_path: Path) -> None:
    result, corpus = _mutant_failed(_guidance(tmp_path, fake_replay, shrink=False))
    assert result.saved is result.first and len(result.saved.trace.program) == len(NOISY)
    assert "not shrunk (--no-shrink)" in result.note and result.reproduced == 1


def test_a_stop_while_shrinking_keeps_the_trace_as_found(tmp_path: Path) -> None:
    def interrupted(trace: SchedulerTrace, call_timeout: Optional[float] = None) -> SchedulerReplay:
        if len(trace.program) < len(NOISY):
            raise KeyboardInterrupt
        return fake_replay(trace)

    result, corpus = _mutant_failed(_guidance(tmp_path, interrupted))
    assert result.interrupted and result.saved is result.first
    assert [path.name for path in corpus.glob("*.json")] == [result.first.path.name]
    assert "shrinking interrupted" in result.note


# -- a batch whose shrinking by Hypothesis drifted to another failure: the first trace shrunk by deletion instead ---


def _session(program: tuple[Operation, ...]) -> SimpleNamespace:
    """What the search's witness reads of an example's session."""
    worker = SimpleNamespace(
        runner_v2=True, write_path=SimpleNamespace(name="vllm"), attention=SimpleNamespace(name="off")
    )
    return SimpleNamespace(program=list(program), setup=SETUP, worker=worker)


def _drifting_search(
    config: SwarmConfig,
    examples: int,
    seed: int,
    shrink: bool,
    witness: Optional[Witness],
    call_timeout: Optional[float],
    journal: Optional[Journal],
) -> Outcome:
    """The first search meets the fake engine's bug in the noisy program; searched again with shrinking, Hypothesis
    ends on another failure (an abort before any step)."""
    program = NOISY if not shrink else (AddRequest([3], 7), Abort("r0"))
    error = fake_replay(_trace(program) if not shrink else _other(program)).error
    assert error is not None and witness is not None
    witness(_session(program), error)  # type: ignore[arg-type]
    return Outcome(config.setup, examples, 10, 0, 0, 0.01, error, "")


def _other(program: tuple[Operation, ...]) -> SchedulerTrace:
    return SchedulerTrace("vllm-v1", SETUP, "V2", "0.33.0", program, _placeholder(), False)


def test_a_batch_whose_hypothesis_shrinking_drifted_shrinks_its_first_trace_by_deletion(tmp_path: Path) -> None:
    target = SchedulerTarget("vllm-v1", lambda setup, runner: None, _drifting_search, fake_replay)
    options = SchedulerCampaignOptions("vllm-v1", 1, tmp_path / "corpus")
    plan = BatchPlan.of(0, SwarmConfig(SETUP, "V2", 20, 0), 1, 5, None, None)
    result = run_batch(target, options, plan, lambda signature, first: True)
    assert result.new and result.drifted is not None and "KeyError" in str(result.drifted.signature)
    assert result.saved is not None and result.saved.trace.program == (AddRequest([3, 2, 1, 0], 7), Step(), Abort("r0"))
    assert result.note is not None and "Hypothesis's shrinking met another failure" in result.note
    assert "shrunk by deleting operations, from 16 operations to 3" in result.note and result.reproduced == 1
    assert result.first is not None and not result.first.path.exists()  # replaced by the shrunk trace
    assert result.saved.path.exists() and result.drifted.saved is not None and result.drifted.saved.path.exists()
    assert "ValueError" in str(result.signature) and "aborting r0" in str(result.outcome.failure)


def test_a_finding_s_trace_is_confirmed_refused_or_found_otherwise_by_one_replay() -> None:
    trace = _trace(NOISY)
    signature = _signature(trace)
    assert shrinking.confirm(trace, signature, fake_replay) == (1, None)
    passing = shrinking.confirm(trace, signature, lambda trace: SchedulerReplay(trace, None, None))
    assert passing == (0, "the trace's replay found: every check passed")

    def refusing(trace: SchedulerTrace) -> SchedulerReplay:
        raise ReplayRefused("vLLM refuses the trace's configuration")

    assert shrinking.confirm(trace, signature, refusing) == (
        None,
        "not confirmed by a replay: vLLM refuses the trace's configuration",
    )


# -- kvfuzz run: the failure found first, when Hypothesis's shrinking reported another --------------------------------


def _saved_pair(tmp_path: Path) -> tuple[SavedTrace[SchedulerTrace], SavedTrace[SchedulerTrace]]:
    """The failure a run found first, saved as found, and the other one it reported."""
    first = save_scheduler_trace(_trace(NOISY), tmp_path)
    other = save_scheduler_trace(_other((AddRequest([3], 7), Abort("r0"))), tmp_path)
    return first, other


def test_a_run_s_first_failure_left_by_hypothesis_is_shrunk_by_deletion(tmp_path: Path) -> None:
    first, other = _saved_pair(tmp_path)
    line = shrinking.shrink_drifted(first, other, fake_replay)
    assert line is not None and line.startswith("kvfuzz: the failure found first (crash) is not the one reported")
    assert "shrunk by deleting operations, from 16 operations to 3" in line
    [shrunk] = [path for path in tmp_path.glob("*.json") if path != other.path]
    assert line.endswith(f": {shrunk}") and not first.path.exists()
    assert load(shrunk).program == (AddRequest([3, 2, 1, 0], 7), Step(), Abort("r0"))


def test_a_run_reporting_its_first_failure_shrinks_nothing_more(tmp_path: Path) -> None:
    """Reported is the first when it is the same file, whether or not it is the same record: Hypothesis's shrunk
    example may be the one found, saved again to the same path (not written: already there)."""
    first, other = _saved_pair(tmp_path)
    again = save_scheduler_trace(first.trace, tmp_path)
    assert again is not first and again.path == first.path and not again.written
    assert shrinking.shrink_drifted(first, first, fake_replay) is None
    assert shrinking.shrink_drifted(first, again, fake_replay) is None
    assert shrinking.shrink_drifted(None, other, fake_replay) is None
    assert first.path.exists() and len(list(tmp_path.glob("*.json"))) == 2


def test_a_run_s_first_failure_that_does_not_replay_is_kept_as_found(tmp_path: Path) -> None:
    first, other = _saved_pair(tmp_path)
    line = shrinking.shrink_drifted(first, other, lambda trace: SchedulerReplay(trace, None, None))
    assert line is not None and f"its unshrunk trace is kept: {first.path}" in line
    assert "its replay found: every check passed" in line and first.path.exists()
