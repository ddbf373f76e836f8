"""The invariant checks, run on what an operation changed (never the whole pool), one checker per invariant over one
shared read-only context (:mod:`~kvfuzz.engine.checks.context`).

Each check raises :class:`~kvfuzz.engine.violations.InvariantViolation` with the sequence, position, block and slot
involved, what was expected, what was found, and where what was found came from
(:mod:`~kvfuzz.engine.checks.explain`).
"""

from __future__ import annotations

from typing import Optional

from kvfuzz.allocator.protocol import AllocatorProtocol, HostIntrospectable, Introspectable
from kvfuzz.engine.checks.accounting import AccountingChecks
from kvfuzz.engine.checks.attention import AttentionCheck
from kvfuzz.engine.checks.cache import CacheSoundness
from kvfuzz.engine.checks.content import ContentChecks
from kvfuzz.engine.checks.context import CheckContext, PoolCounts
from kvfuzz.engine.checks.divergence import DivergenceAudit
from kvfuzz.engine.checks.eviction_order import CacheSnapshot, EvictionOrder
from kvfuzz.engine.checks.exclusive import ExclusiveWrites
from kvfuzz.engine.checks.quiescence import Quiescence
from kvfuzz.engine.checks.refusals import RefusalChecks
from kvfuzz.engine.checks.results import ResultChecks
from kvfuzz.engine.checks.window import InflightWindow
from kvfuzz.engine.expected import ExpectedState
from kvfuzz.engine.pools import KVPools

__all__ = ["CacheSnapshot", "CheckContext", "Checks", "PoolCounts"]


class Checks:
    """One engine's checkers, one per invariant, sharing one context. The
    allocator's set queries other code reads (``counts``, ``cached_set``, the introspection) and the operation label
    are the context's."""

    def __init__(self, state: ExpectedState, pools: KVPools, allocator: AllocatorProtocol, kernel_name: str) -> None:
        context = CheckContext(state, pools, allocator)
        self.context = context
        self.content = ContentChecks(context)  # invariant 1
        self.attention = AttentionCheck(context, kernel_name)  # invariant 2
        self.accounting = AccountingChecks(context)  # invariants 3 and 4
        self.exclusive = ExclusiveWrites(context)  # invariant 5
        self.window = InflightWindow(context)  # invariant 6
        self.refusals = RefusalChecks(context, self.accounting)  # invariants 7, 8 and 11
        self.cache = CacheSoundness(context, self.exclusive)  # invariant 9
        self.quiescence = Quiescence(context, self.accounting)  # invariant 10
        self.results = ResultChecks(context)  # invariant 12
        self.eviction_order = EvictionOrder(context)  # invariant 13
        self.divergence = DivergenceAudit(context, self.accounting)  # the whole state, for a replay's signature

    @property
    def operation(self) -> str:
        """The operation being checked, as a call a person can read."""
        return self.context.operation

    @operation.setter
    def operation(self, label: str) -> None:
        self.context.operation = label

    @property
    def introspection(self) -> Optional[Introspectable]:
        return self.context.introspection

    @property
    def host_introspection(self) -> Optional[HostIntrospectable]:
        return self.context.host_introspection

    def counts(self) -> Optional[PoolCounts]:
        """The sizes of the allocator's sets, or None without introspection."""
        return self.context.counts()

    def cached_set(self) -> Optional[frozenset[int]]:
        """The allocator's cached (evictable) blocks now, or None without introspection."""
        return self.context.cached_set()
