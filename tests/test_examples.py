"""The README's worked example: a user's own allocator, plugged in and fuzzed, and one of its slips caught."""

from __future__ import annotations

from hypothesis.stateful import run_state_machine_as_test

from examples.simple_allocator import SimpleAllocator, make_allocator
from kvfuzz.allocator import InvalidArgument
from kvfuzz.profiles import PROFILES
from kvfuzz.runner import run
from kvfuzz.statemachines import Invariant, MachineConfig, machine_for


def test_simple_allocator_passes() -> None:
    run_state_machine_as_test(machine_for(make_allocator, MachineConfig()), settings=PROFILES["ci"])


class ForgetsRolledBackBlocks(SimpleAllocator):
    """Rollback trims the length but never returns the emptied blocks."""

    def rollback(self, seq, num_tokens):
        if not 1 <= num_tokens < self.lengths.get(seq, 0):
            raise InvalidArgument(f"cannot drop {num_tokens} tokens")
        self.lengths[seq] -= num_tokens


def test_a_slip_in_the_users_allocator_is_caught() -> None:
    summary = run(ForgetsRolledBackBlocks, MachineConfig(), examples=300, shrink=False)
    assert summary.failed and summary.violated is Invariant.REFCOUNTS, summary.explanation
