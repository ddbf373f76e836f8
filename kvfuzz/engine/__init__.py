"""The engine model kvfuzz plays around an allocator, without Hypothesis: the K/V pools, the expected state, the
engine that drives an allocator, the invariant checks, misuse calls and the violations they raise."""

from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.engine import Engine, GeometryMismatch
from kvfuzz.engine.expected import BlockRefs, ExpectedState, SeqModel, Status
from kvfuzz.engine.misuse import MisuseCall, misuse_calls
from kvfuzz.engine.pools import KVPools, SlotWrite
from kvfuzz.engine.violations import Invariant, InvariantViolation

__all__ = [
    "BlockRefs",
    "Engine",
    "ExpectedState",
    "GeometryMismatch",
    "Invariant",
    "InvariantViolation",
    "KVPools",
    "MachineConfig",
    "MisuseCall",
    "SeqModel",
    "SlotWrite",
    "Status",
    "misuse_calls",
]
