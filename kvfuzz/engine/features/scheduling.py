"""Scheduling and preemption: what becomes of a freed sequence's scheduled writes (``free_lands_scheduled_writes``).

This module is the one place that owns that capability's combinations with the host tier and with KV-cache groups:
:func:`abort_policy` picks the policy once, when the engine is built.
"""

from __future__ import annotations

from typing import Optional, Protocol

from kvfuzz.allocator.types import SeqId
from kvfuzz.engine.core import EngineCore
from kvfuzz.engine.features.host_tier import HostTier


class AbortPolicy(Protocol):
    """What the engine does with the writes a running sequence had scheduled when it is freed."""

    def abort(self, seq: SeqId, run_ends: bool) -> None: ...


class WithdrawnWrites:
    """The writes are withdrawn with the sequence: no other sequence may have hit them, unless the run ends (every
    sequence goes, and nothing reads again)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core  # the engine this policy is part of

    def abort(self, seq: SeqId, run_ends: bool) -> None:
        if run_ends:
            return
        for table_id in (seq, *self.core.expected.group_tables(seq)):
            self.core.withdraw_writes(table_id, f"free({seq!r})")


class LandedWrites:
    """``free_lands_scheduled_writes``: the step they were scheduled for runs in full, abort or not; with nothing to
    order them against, they land at once (every group table's)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core  # the engine this policy is part of

    def abort(self, seq: SeqId, run_ends: bool) -> None:
        for table_id in (seq, *self.core.expected.group_tables(seq)):
            slots, writes = self.core.take_scheduled_writes(table_id, "scheduled before the abort")
            if slots:
                self.core.pools.write(slots, writes)


class DeferredWrites:
    """``free_lands_scheduled_writes`` with a host tier (and one KV-cache group): the next launch makes them, after
    the transfers it lands, as the worker would."""

    def __init__(self, host_tier: HostTier) -> None:
        self.host_tier = host_tier  # who lands them at the next launch

    def abort(self, seq: SeqId, run_ends: bool) -> None:
        self.host_tier.defer_aborted(seq)


def abort_policy(core: EngineCore, host_tier: Optional[HostTier]) -> AbortPolicy:
    """The policy for a freed sequence's scheduled writes that the allocator's capabilities call for."""
    caps = core.caps
    if not caps.free_lands_scheduled_writes:
        return WithdrawnWrites(core)
    if host_tier is not None and not caps.kv_groups:
        return DeferredWrites(host_tier)
    return LandedWrites(core)
