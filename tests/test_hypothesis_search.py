"""The one Hypothesis search every target runs (kvfuzz/hypothesis_search.py): how a search ended is told apart once,
and each target settles it the same way. Hypothesis's own error is never a finding; a stop from outside, found
inside whatever Hypothesis wrapped it in, is the stop; a Flaky is settled from the failing examples the target met.

Each case replaces the test Hypothesis builds from the machine with one that ends as the case says, and runs it
through both targets' searches: the allocator's (``kvfuzz.runner.run``) and the scheduler's
(``kvfuzz.scheduler.search.search``, its machine never built, so no engine is needed)."""

from __future__ import annotations

from typing import Callable

import pytest
from hypothesis.errors import Flaky, FlakyFailure, FlakyStrategyDefinition, Unsatisfiable

from kvfuzz import hypothesis_search
from kvfuzz.allocator.paged import PagedAllocator
from kvfuzz.program.safeguards import UserInterrupt
from kvfuzz.runner import RunSummary, run
from kvfuzz.scheduler import search as scheduler_search
from kvfuzz.scheduler.config import SchedulerSetup


def _ending(monkeypatch: pytest.MonkeyPatch, test: Callable[[], None]) -> None:
    """Every search's Hypothesis test is ``test``."""
    monkeypatch.setattr(hypothesis_search, "get_state_machine_test", lambda machine, settings: test)


def _raising(error: BaseException, cause: BaseException | None = None) -> Callable[[], None]:
    def test() -> None:
        if cause is None:
            raise error
        raise error from cause

    return test


def _allocator_run() -> RunSummary:
    return run(PagedAllocator, examples=2, steps=3, random_examples=0, call_timeout=None)


def _scheduler_search(monkeypatch: pytest.MonkeyPatch) -> scheduler_search.Outcome:
    monkeypatch.setattr(scheduler_search, "machine_for_setup", lambda *args, **kwargs: object)
    return scheduler_search.search(SchedulerSetup(), examples=1, steps=1)


def test_a_search_that_passes_passes_on_both_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    _ending(monkeypatch, lambda: None)
    assert not _allocator_run().failed
    outcome = _scheduler_search(monkeypatch)
    assert outcome.failure is None and outcome.harness is None and not outcome.cut_off


def test_the_machine_s_failure_is_the_finding_on_both_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    failure = ValueError("the machine's own failure")
    _ending(monkeypatch, _raising(failure))
    summary = _allocator_run()
    assert summary.failed and summary.failure is failure and summary.invariant == "crash (ValueError)"
    outcome = _scheduler_search(monkeypatch)
    assert outcome.failure is failure and outcome.harness is None


@pytest.mark.parametrize(
    "error",
    [Unsatisfiable("no example satisfied the preconditions"), FlakyStrategyDefinition("Inconsistent data generation!")],
    ids=["unsatisfiable", "flaky-strategy-with-no-failure-met"],
)
def test_hypothesis_s_own_error_is_never_a_finding(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    """With no failure met, Hypothesis's error is kvfuzz's: the allocator's run raises it rather than report a
    crash of the allocator; the scheduler's search stops with a harness error naming it."""
    _ending(monkeypatch, _raising(error))
    with pytest.raises(type(error)):
        _allocator_run()
    outcome = _scheduler_search(monkeypatch)
    assert outcome.failure is None and outcome.harness is not None
    assert type(error).__name__ in outcome.harness.hint


def test_a_ctrl_c_that_hypothesis_wraps_in_a_flaky_failure_is_the_users_interrupt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hypothesis replays its failing example once more at the end; a Ctrl-C landing then comes back wrapped inside
    a FlakyFailure next to the failure first seen. The run must stop as interrupted, not shrink and confirm on as if
    the allocator were flaky (a run whose Ctrl-C came by a timer that fired in that replay ignored it); the
    scheduler's search raises the interrupt."""
    first_seen = ValueError("the failure Hypothesis found")
    _ending(monkeypatch, _raising(FlakyFailure("Inconsistent results", [first_seen, UserInterrupt()])))
    summary = _allocator_run()
    assert summary.interrupted and not summary.failed
    with pytest.raises(UserInterrupt):
        _scheduler_search(monkeypatch)


def test_a_ctrl_c_behind_hypothesis_s_flaky_is_the_users_interrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same interrupt as the cause of a Flaky (not one of its exceptions): the interrupt, on both targets."""
    _ending(monkeypatch, _raising(Flaky("replay went differently"), UserInterrupt()))
    assert _allocator_run().interrupted
    with pytest.raises(UserInterrupt):
        _scheduler_search(monkeypatch)


def test_a_flaky_failure_with_nothing_else_met_is_the_failure_first_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The allocator's run reports the failure Hypothesis first saw (no shorter program met); the scheduler's
    search, which met no failing example itself, cannot say which program failed: a harness error, never a
    finding without its program."""
    first_seen = ValueError("the failure Hypothesis found")
    _ending(monkeypatch, _raising(FlakyFailure("Inconsistent results", [first_seen, RuntimeError("other")])))
    summary = _allocator_run()
    assert summary.failed and summary.failure is first_seen
    outcome = _scheduler_search(monkeypatch)
    assert outcome.failure is None and outcome.harness is not None and "FlakyFailure" in outcome.harness.hint


@pytest.mark.parametrize("wrapped", [True, False], ids=["inside-hypothesis-s-error", "bare"])
def test_a_cut_off_landing_while_hypothesis_draws_ends_the_search_as_cut_off(
    monkeypatch: pytest.MonkeyPatch, wrapped: bool
) -> None:
    """The batch deadline's alarm can fire while Hypothesis draws an example's data: Hypothesis then finds the data
    drawn differently from its last run and raises its own FlakyStrategyDefinition, with the cut-off as its context.
    That is the cut-off (the search ended from outside, what ran counted), never a harness error that ends the
    campaign (seen in a ten-minute campaign, which stopped at 152 s)."""

    def test() -> None:
        try:
            raise scheduler_search.SearchCutOff()
        except scheduler_search.SearchCutOff:
            if wrapped:
                raise FlakyStrategyDefinition("Inconsistent data generation!") from None
            raise

    _ending(monkeypatch, test)
    outcome = _scheduler_search(monkeypatch)
    assert outcome.cut_off and outcome.harness is None and outcome.failure is None


def test_a_stop_that_is_not_the_caller_s_cut_off_passes_through() -> None:
    """A BaseException the search does not know (a hang, a harness error) is the caller's to handle."""

    class Stop(BaseException):
        pass

    class Other(BaseException):
        pass

    def machine_raising(error: BaseException) -> type:
        from hypothesis.stateful import RuleBasedStateMachine, rule

        class Machine(RuleBasedStateMachine):
            @rule()
            def go(self) -> None:
                raise error

        return Machine

    settings = hypothesis_search.Settings(max_examples=1, database=None, deadline=None)
    with pytest.raises(Other):
        hypothesis_search.search_machine(machine_raising(Other()), settings, seed=0, cut_offs=(Stop,))
    ended = hypothesis_search.search_machine(machine_raising(Stop()), settings, seed=0, cut_offs=(Stop,))
    assert ended.cut_off and ended.failure is None and ended.error is None
    failing = hypothesis_search.search_machine(machine_raising(KeyError("k")), settings, seed=0)
    assert isinstance(failing.failure, KeyError) and failing.error is None and failing.examples


class _Stop(BaseException):
    """A stop raised from outside."""


def test_a_stop_that_hypothesis_s_bookkeeping_fails_on_is_the_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop raised from outside can land between two lines of Hypothesis's drawing code, which then fails on its
    half-updated state as it unwinds: an ``IndexError: pop from empty list`` in ``ConjectureData.stop_span``, with
    the stop as its context (seen at a 90-second campaign's end, reported as a new crash "found" in Hypothesis). That
    is the stop: the scheduler's search is cut off, the user's interrupt is raised again on both targets."""

    def failing_as_it_unwinds(stop: BaseException) -> Callable[[], None]:
        def test() -> None:
            try:
                raise stop
            except BaseException:
                [].pop()

        return test

    _ending(monkeypatch, failing_as_it_unwinds(scheduler_search.SearchCutOff()))
    outcome = _scheduler_search(monkeypatch)
    assert outcome.cut_off and outcome.failure is None and outcome.harness is None
    _ending(monkeypatch, failing_as_it_unwinds(UserInterrupt()))
    assert _allocator_run().interrupted
    with pytest.raises(UserInterrupt):
        _scheduler_search(monkeypatch)


def test_an_error_raised_in_hypothesis_s_own_code_is_never_a_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain exception whose innermost frame is Hypothesis's (here an index past the end of one of its own integer
    lists) is Hypothesis's error, not the machine's: the allocator's run raises it, the scheduler's search stops with
    a harness error naming it."""
    from hypothesis.internal.conjecture.junkdrawer import IntList

    _ending(monkeypatch, lambda: IntList([])[3])
    with pytest.raises(IndexError):
        _allocator_run()
    outcome = _scheduler_search(monkeypatch)
    assert outcome.failure is None and outcome.harness is not None
    assert "raised IndexError at" in outcome.harness.hint and "junkdrawer.py" in outcome.harness.hint


def test_a_failure_that_handled_a_stop_is_still_the_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Code that turns a stop into its own report (``raise ... from None``, as the hang check turns the watchdog's
    interrupt into a hang violation) has handled it: its report is the finding."""
    failure = ValueError("the hang check's violation")

    def test() -> None:
        try:
            raise _Stop()
        except _Stop:
            raise failure from None

    _ending(monkeypatch, test)
    outcome = _scheduler_search(monkeypatch)
    assert outcome.failure is failure and not outcome.cut_off


def test_cut_offs_at_random_moments_of_a_real_search_never_make_a_finding() -> None:
    """A machine that always passes, drawing lists of integers each step (so that most of a search's time is spent
    in Hypothesis's own drawing code), cut off by a campaign's alarm (``searching_until``) at 150 random moments:
    every search ends as cut off or passed, never with a failure or Hypothesis's error. (Before stops were looked for
    behind plain exceptions, about one cut-off in eight ended as an IndexError or AssertionError "found" in
    Hypothesis's bookkeeping.)"""
    import random
    import time

    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, rule

    from kvfuzz.campaign.scheduler.loop import searching_until

    class Passing(RuleBasedStateMachine):
        @rule(values=st.lists(st.integers(), max_size=20))
        def draw(self, values: list[int]) -> None:
            assert len(values) <= 20

    settings = hypothesis_search.Settings(max_examples=10_000, database=None, deadline=None, stateful_step_count=20)
    rng = random.Random(20261207)
    endings: list[str] = []
    for seed in range(150):
        try:
            with searching_until(time.monotonic() + rng.uniform(0.001, 0.05)):
                ended = hypothesis_search.search_machine(
                    Passing, settings, seed=seed, cut_offs=(scheduler_search.SearchCutOff,)
                )
        except scheduler_search.SearchCutOff:  # landed before or after the search itself
            endings.append("outside")
            continue
        endings.append(
            f"failure {ended.failure!r}"
            if ended.failure is not None
            else f"error {ended.error!r}"
            if ended.error is not None
            else "cut off"
            if ended.cut_off
            else "passed"
        )
    assert set(endings) <= {"outside", "cut off", "passed"}, sorted(set(endings))
    assert endings.count("cut off") > 100


@pytest.mark.parametrize("stop", [scheduler_search.SearchCutOff, UserInterrupt], ids=["campaign-end", "ctrl-c"])
def test_a_replay_whose_session_fails_as_a_stop_unwinds_it_raises_the_stop(stop: type[BaseException]) -> None:
    """A guided campaign's mutants are replayed, not searched: a stop landing in the session, whose cleanup then
    fails on its half-done step (an AssertionError in a ``finally``), is the stop raised again, never a finding; an
    exception the session raises on its own is the replay's finding."""
    from kvfuzz.scheduler.program import Step
    from kvfuzz.scheduler.replay_result import replay_program
    from kvfuzz.scheduler.trace import RecordedFailure, SchedulerTrace

    class Session:
        engine = "a fake engine"

        def __init__(self, failing: Callable[[], None]) -> None:
            self.failing = failing

        def step(self) -> int:
            self.failing()
            return 0

        def drain(self) -> None:
            pass

    def unwinding() -> None:
        try:
            raise stop()
        finally:
            raise AssertionError("the step's cleanup finds it half done")

    def failing() -> None:
        raise ValueError("the engine's own failure")

    running = RecordedFailure("crash", "(none: a program run for coverage)", "NoFailure")
    trace = SchedulerTrace("vllm-v1", SchedulerSetup(), "V2", "0.33.0", [Step()], running, False)
    with pytest.raises(stop):
        replay_program(Session(unwinding), trace)
    replayed = replay_program(Session(failing), trace)
    assert isinstance(replayed.error, ValueError) and replayed.failed_at == 0
