"""The Hypothesis layer: a rule-based state machine built from the operation table.

The engine model lives in :mod:`kvfuzz.engine` and programs in :mod:`kvfuzz.program`; the names below are
re-exported here because tests exported by ``kvfuzz export`` import them from this package.
"""

from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.misuse import MisuseCall
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.registry import AllocatorFactory
from kvfuzz.statemachines.machine import KVCacheMachine, machine_for

__all__ = [
    "AllocatorFactory",
    "Invariant",
    "InvariantViolation",
    "KVCacheMachine",
    "MachineConfig",
    "MisuseCall",
    "machine_for",
]
