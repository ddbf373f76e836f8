"""The allocator contract (protocol, capabilities, errors, result types) and kvfuzz's own correct allocator."""

from kvfuzz.allocator.errors import (
    AllocatorError,
    InvalidArgument,
    Misuse,
    OutOfBlocks,
    SequenceExists,
    UnknownSequence,
    Unsupported,
)
from kvfuzz.allocator.paged import PagedAllocator, paged_allocator, synchronous_allocator
from kvfuzz.allocator.protocol import AllocatorProtocol, GroupedTables, HostCache, HostIntrospectable, Introspectable
from kvfuzz.allocator.types import (
    AdmitResult,
    BlockCopy,
    Capabilities,
    EvictionOrder,
    GrowResult,
    HostTransfers,
    KVGroup,
    Namespace,
    PoolSpec,
    SeqId,
    Slot,
    SwapResult,
    Tokens,
)

__all__ = [
    "AdmitResult",
    "AllocatorError",
    "AllocatorProtocol",
    "BlockCopy",
    "Capabilities",
    "EvictionOrder",
    "GroupedTables",
    "GrowResult",
    "HostCache",
    "HostIntrospectable",
    "HostTransfers",
    "Introspectable",
    "InvalidArgument",
    "KVGroup",
    "Misuse",
    "Namespace",
    "OutOfBlocks",
    "PagedAllocator",
    "PoolSpec",
    "SeqId",
    "SequenceExists",
    "Slot",
    "SwapResult",
    "Tokens",
    "UnknownSequence",
    "Unsupported",
    "paged_allocator",
    "synchronous_allocator",
]
