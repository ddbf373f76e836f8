"""The adapters' shared sequence ledger: each call on a sequence in the wrong phase raises the misuse error the
contract names, and a check changes nothing."""

from __future__ import annotations

import pytest

from kvfuzz.adapters.base import Phase, SequenceLedger
from kvfuzz.allocator import InvalidArgument, Misuse, SequenceExists, UnknownSequence


def _ledger(**phases: Phase) -> SequenceLedger:
    ledger = SequenceLedger()
    ledger.phases.update(phases)
    return ledger


@pytest.mark.parametrize(
    ("phase", "call", "error"),
    [
        (None, lambda ledger: ledger.running("s", "grow"), UnknownSequence),
        (Phase.PREEMPTED, lambda ledger: ledger.running("s", "grow"), UnknownSequence),
        (Phase.SWAPPED, lambda ledger: ledger.running("s", "grow"), InvalidArgument),
        (None, lambda ledger: ledger.live("s", "free"), UnknownSequence),
        (Phase.PREEMPTED, lambda ledger: ledger.live("s", "free"), UnknownSequence),
        (Phase.RUNNING, lambda ledger: ledger.swapped("s", "swap_in"), InvalidArgument),
        (None, lambda ledger: ledger.swapped("s", "swap_in"), InvalidArgument),
        (Phase.RUNNING, lambda ledger: ledger.check_admit("s", (1,)), SequenceExists),
        (Phase.SWAPPED, lambda ledger: ledger.check_admit("s", (1,)), SequenceExists),
        (None, lambda ledger: ledger.check_admit("s", ()), InvalidArgument),
        (Phase.RUNNING, lambda ledger: ledger.check_tokens("grow", "s", ()), InvalidArgument),
        (None, lambda ledger: ledger.check_fork("s", "child"), UnknownSequence),
    ],
)
def test_a_call_in_the_wrong_phase_is_refused_as_misuse_and_changes_nothing(phase, call, error) -> None:
    ledger = _ledger(**({} if phase is None else {"s": phase}))
    before = dict(ledger.phases)
    with pytest.raises(error) as raised:
        call(ledger)
    assert isinstance(raised.value, Misuse) and "'s'" in str(raised.value)
    assert ledger.phases == before


def test_a_fork_into_a_live_child_is_refused() -> None:
    with pytest.raises(SequenceExists):
        _ledger(s=Phase.RUNNING, child=Phase.SWAPPED).check_fork("s", "child")


def test_the_phases_follow_the_transitions() -> None:
    ledger = SequenceLedger()
    assert ledger.check_admit("s", (1,)) is False
    ledger.admitted("s")
    ledger.running("s", "grow")
    ledger.swapped_out("s")
    assert ledger.live("s", "free") is Phase.SWAPPED
    ledger.swapped("s", "swap_in")
    ledger.admitted("s")
    ledger.preempted("s")
    assert ledger.ids(Phase.PREEMPTED) == ["s"]
    assert ledger.check_admit("s", (1,)) is True  # comes back from preemption
    ledger.admitted("s")
    ledger.freed("s")
    assert ledger.phases == {}
