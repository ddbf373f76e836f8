"""What every adapter needs whatever library it wraps: which sequences it holds, in which phase, and the contract's
typed misuse errors for a call on a sequence in the wrong phase.

Third-party block managers often ignore an unknown sequence id, or fail on it with their own exception; the contract
asks for a :class:`~kvfuzz.allocator.errors.Misuse` error that changes nothing. An adapter asks its
:class:`SequenceLedger` before it calls the library, and records each transition after the library accepted it, so
no adapter re-implements those checks.
"""

from __future__ import annotations

import enum
from typing import Sequence

from kvfuzz.allocator.errors import InvalidArgument, SequenceExists, UnknownSequence
from kvfuzz.allocator.types import SeqId


class Phase(enum.Enum):
    """Where a sequence the adapter holds is."""

    RUNNING = "running"
    SWAPPED = "swapped out"
    PREEMPTED = "preempted"
    LOADING = "waiting for its loads"  # admitted under async_loads: holds blocks, computes nothing until resumed


class SequenceLedger:
    """The sequences an adapter holds and their phases.

    Invariant kept: a sequence is in ``phases`` from its admission (or fork) until it is freed, with the phase of its
    last transition; a freed sequence, or one never admitted, is absent. Each check raises the misuse error the
    contract names and changes nothing; each transition is recorded only once the library has accepted the call.
    """

    def __init__(self) -> None:
        self.phases: dict[SeqId, Phase] = {}  # every sequence held: running, swapped out, preempted, or loading

    # -- checks, before the library is called --------------------------------------------------------------------

    def check_admit(self, seq: SeqId, tokens: Sequence[int]) -> bool:
        """``admit(seq, ...)`` may go ahead; returns whether ``seq`` comes back from preemption."""
        phase = self.phases.get(seq)
        if phase is Phase.RUNNING or phase is Phase.SWAPPED or phase is Phase.LOADING:
            raise SequenceExists(f"admit: sequence {seq!r} is already live ({phase.value})")
        self.check_tokens("admit", seq, tokens)
        return phase is Phase.PREEMPTED

    def check_fork(self, parent: SeqId, child: SeqId) -> None:
        """``fork(parent, child)`` may go ahead: the parent runs and the child id is not live."""
        self.running(parent, "fork")
        phase = self.phases.get(child)
        if phase is Phase.RUNNING or phase is Phase.SWAPPED:
            raise SequenceExists(f"fork: child {child!r} is already live ({phase.value})")

    @staticmethod
    def check_tokens(op: str, seq: SeqId, tokens: Sequence[int]) -> None:
        if not tokens:
            raise InvalidArgument(f"{op}: sequence {seq!r} given no tokens")

    def running(self, seq: SeqId, op: str) -> None:
        """``seq`` is running: raises UnknownSequence if it is not held (never admitted, freed, or preempted) and
        InvalidArgument if it is swapped out."""
        phase = self._held(seq, op)
        if phase is Phase.SWAPPED or phase is Phase.LOADING:
            raise InvalidArgument(f"{op}: sequence {seq!r} is {phase.value}")

    def live(self, seq: SeqId, op: str) -> Phase:
        """``seq`` holds blocks on the device or the host (running, swapped out, or waiting for its loads); returns
        which."""
        return self._held(seq, op)

    def swapped(self, seq: SeqId, op: str) -> None:
        """``seq`` is swapped out."""
        if self.phases.get(seq) is not Phase.SWAPPED:
            raise InvalidArgument(f"{op}: sequence {seq!r} is not swapped out")

    def _held(self, seq: SeqId, op: str) -> Phase:
        phase = self.phases.get(seq)
        if phase is None or phase is Phase.PREEMPTED:
            raise UnknownSequence(f"{op}: sequence {seq!r} is not live (never admitted, freed, or preempted)")
        return phase

    # -- transitions, once the library has accepted the call -----------------------------------------------------

    def admitted(self, seq: SeqId) -> None:
        """Admitted, forked, or swapped back in: running."""
        self.phases[seq] = Phase.RUNNING

    def loading(self, seq: SeqId) -> None:
        """Admitted under ``async_loads``: waiting for its loads (then for ``resume``)."""
        self.phases[seq] = Phase.LOADING

    def swapped_out(self, seq: SeqId) -> None:
        self.phases[seq] = Phase.SWAPPED

    def preempted(self, seq: SeqId) -> None:
        self.phases[seq] = Phase.PREEMPTED

    def freed(self, seq: SeqId) -> None:
        del self.phases[seq]

    def ids(self, phase: Phase) -> list[SeqId]:
        return [seq for seq, current in self.phases.items() if current is phase]
