"""``kvfuzz.allocator.PagedAllocator`` answers every misuse with a typed error and changes nothing."""

from __future__ import annotations

from typing import Callable

import pytest
from factories import B, make, snapshot, toks

from kvfuzz.allocator import InvalidArgument, Misuse, PagedAllocator, SequenceExists, UnknownSequence

# -- misuse: typed errors, nothing changed --------------------------------------------------------------------------

SEQS = ["run", "fork", "swapped", "dead", "nope"]


def _misuse_state() -> PagedAllocator:
    """W = 1 with a running sequence and its fork, a swapped one, a freed one, pending blocks, cached blocks and
    registrations still in flight."""
    a = make(12, window=1, host=4)
    a.admit("run", ("ns",), toks(0, B + 2))
    a.admit("swapped", (), toks(100, B))
    a.admit("dead", (), toks(200, 2 * B))
    a.step_completed(0)
    a.step_completed(1)
    a.fork("run", "fork")
    a.swap_out("swapped")
    a.free("dead")
    a.admit("late", (), toks(300, 2 * B))  # registration pending
    return a


MISUSES: list[tuple[str, Callable[[PagedAllocator], object], type]] = [
    ("grow unknown", lambda a: a.grow("nope", (1,)), UnknownSequence),
    ("grow freed", lambda a: a.grow("dead", (1,)), UnknownSequence),
    ("grow swapped", lambda a: a.grow("swapped", (1,)), Misuse),
    ("grow no tokens", lambda a: a.grow("run", ()), InvalidArgument),
    ("free unknown", lambda a: a.free("nope"), UnknownSequence),
    ("double free", lambda a: a.free("dead"), UnknownSequence),
    ("preempt unknown", lambda a: a.preempt("nope"), UnknownSequence),
    ("preempt freed", lambda a: a.preempt("dead"), UnknownSequence),
    ("preempt swapped", lambda a: a.preempt("swapped"), Misuse),
    ("admit live id", lambda a: a.admit("run", (), (1, 2)), SequenceExists),
    ("admit swapped id", lambda a: a.admit("swapped", (), (1, 2)), SequenceExists),
    ("admit empty", lambda a: a.admit("new", (), ()), InvalidArgument),
    ("fork onto live id", lambda a: a.fork("run", "fork"), SequenceExists),
    ("fork onto swapped id", lambda a: a.fork("run", "swapped"), SequenceExists),
    ("fork onto itself", lambda a: a.fork("run", "run"), SequenceExists),
    ("fork unknown parent", lambda a: a.fork("nope", "new"), UnknownSequence),
    ("fork freed parent", lambda a: a.fork("dead", "new"), UnknownSequence),
    ("fork swapped parent", lambda a: a.fork("swapped", "new"), Misuse),
    ("rollback all tokens", lambda a: a.rollback("run", B + 2), InvalidArgument),
    ("rollback too many", lambda a: a.rollback("run", B + 3), InvalidArgument),
    ("rollback zero", lambda a: a.rollback("run", 0), InvalidArgument),
    ("rollback negative", lambda a: a.rollback("run", -1), InvalidArgument),
    ("rollback unknown", lambda a: a.rollback("nope", 1), UnknownSequence),
    ("rollback swapped", lambda a: a.rollback("swapped", 1), Misuse),
    ("swap_in running", lambda a: a.swap_in("run"), InvalidArgument),
    ("swap_in unknown", lambda a: a.swap_in("nope"), Misuse),
    ("swap_in freed", lambda a: a.swap_in("dead"), Misuse),
    ("swap_out swapped", lambda a: a.swap_out("swapped"), Misuse),
    ("swap_out unknown", lambda a: a.swap_out("nope"), UnknownSequence),
    ("step_completed repeated", lambda a: a.step_completed(1), InvalidArgument),
    ("step_completed backwards", lambda a: a.step_completed(0), InvalidArgument),
    ("step_completed far back", lambda a: a.step_completed(-5), InvalidArgument),
    ("evict negative", lambda a: a.evict(-1), InvalidArgument),
    ("block_table unknown", lambda a: a.block_table("nope"), UnknownSequence),
]


@pytest.mark.parametrize("call, error", [(c, e) for _, c, e in MISUSES], ids=[name for name, _, _ in MISUSES])
def test_misuse_raises_a_typed_error_and_changes_nothing(call, error) -> None:
    a = _misuse_state()
    reference = _misuse_state()
    before = snapshot(a, SEQS)
    assert before == snapshot(reference, SEQS)
    with pytest.raises(error) as caught:
        call(a)
    assert isinstance(caught.value, Misuse)
    assert snapshot(a, SEQS) == before
    # And nothing hidden changed: the same continuation gives the same results as on an untouched allocator.
    assert _continuation(a) == _continuation(reference)


def _continuation(a: PagedAllocator) -> list:
    results = []
    results.append(a.grow("run", (7,)))
    results.append(a.grow("fork", (8,)))
    results.append(a.swap_in("swapped"))
    for step in (2, 3):
        a.step_completed(step)
        results.append(snapshot(a, SEQS + ["late"]))
    results.append(a.admit("probe1", (), toks(300, 2 * B)))
    results.append(a.admit("probe2", (), toks(200, 2 * B)))
    results.append(a.admit("probe3", ("ns",), toks(0, B + 2)))
    results.append(a.evict(100))
    results.append(snapshot(a, SEQS + ["late", "probe1", "probe2", "probe3"]))
    return results
