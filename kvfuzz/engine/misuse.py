"""Misuse: calls that break the contract, which an allocator must refuse with a typed error, changing nothing."""

from __future__ import annotations

import attrs

from kvfuzz.allocator.protocol import declares
from kvfuzz.engine.expected import ProgramState, Status


@attrs.frozen
class MisuseCall:
    """A call that breaks the contract and must be refused with a :class:`~kvfuzz.allocator.errors.Misuse`."""

    op: str
    args: tuple
    why: str

    def __str__(self) -> str:
        return f"{self.op}{self.args!r}"


def misuse_calls(state: ProgramState) -> list[MisuseCall]:
    """The contract-breaking calls that make sense in the current state, each to a method the allocator declares (an
    undeclared operation is never called, not even to see it refused)."""
    calls = [MisuseCall("grow", ("nobody", (1,)), "nobody was ever admitted")]
    for seq in state.finished[-1:]:
        calls += [
            MisuseCall("free", (seq,), f"{seq} was already freed"),
            MisuseCall("grow", (seq, (1,)), f"{seq} was freed"),
        ]
    for seq in state.computed_ids()[:1]:
        calls += [
            MisuseCall("admit", (seq, (), (1,)), f"{seq} is live"),
            MisuseCall("grow", (seq, ()), "no tokens"),
            MisuseCall("rollback", (seq, state.length(seq)), "would drop every token"),
            MisuseCall("fork", ("nobody", seq), f"unknown parent, and {seq} is live"),
            MisuseCall("swap_in", (seq,), f"{seq} is not swapped out"),
        ]
    for seq in state.ids(Status.PREEMPTED)[:1]:
        calls.append(MisuseCall("grow", (seq, (1,)), f"{seq} is preempted"))
    return [call for call in calls if declares(state.caps, call.op)]
