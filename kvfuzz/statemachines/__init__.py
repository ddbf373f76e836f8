"""The Hypothesis machine, the engine model it plays around an allocator, and the invariants it checks."""

from kvfuzz.statemachines.config import MachineConfig
from kvfuzz.statemachines.harness import Harness
from kvfuzz.statemachines.machine import AllocatorFactory, KVCacheMachine, machine_for
from kvfuzz.statemachines.misuse import MisuseCall
from kvfuzz.statemachines.violations import Invariant, InvariantViolation

__all__ = [
    "AllocatorFactory",
    "Harness",
    "Invariant",
    "InvariantViolation",
    "KVCacheMachine",
    "MachineConfig",
    "MisuseCall",
    "machine_for",
]
