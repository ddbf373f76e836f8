"""What every invariant's checks share: one read-only context (the expected state, the engine's pools, the allocator
and its optional queries), the queries of the allocator's sets that several checks make, and the label of the
operation being checked, which every violation carries."""

from __future__ import annotations

from typing import Callable, Iterable, NoReturn, Optional, Sequence, Union, cast

import attrs

from kvfuzz.allocator.protocol import AllocatorProtocol, GroupedTables, HostIntrospectable, Introspectable
from kvfuzz.engine.expected import ExpectedState
from kvfuzz.engine.pools import KVPools
from kvfuzz.engine.violations import UNNAMED, Cause, Invariant, violation


@attrs.frozen
class PoolCounts:
    """Sizes of the allocator's free, cached (evictable) and pending sets."""

    free: int  # device blocks free
    cached: int  # device blocks cached and unreferenced
    pending: int  # device blocks inside the in-flight window
    host_free: Optional[int] = None  # host blocks free, where the allocator exposes its host free set


class CheckContext:
    """The one context every checker reads: it never changes what it refers to (the engine updates the state and the
    pools it holds), only ``operation``, the label of the call being checked, which the engine sets. Every invariant
    failure is raised through :meth:`fail`, labelled with it."""

    def __init__(self, state: ExpectedState, pools: KVPools, allocator: AllocatorProtocol) -> None:
        self.state = state  # what the engine expects of the allocator
        self.pools = pools  # the K/V the engine wrote, and who wrote each slot
        self.allocator = allocator  # the allocator under test
        # Its optional queries, when it declares them (kvfuzz.allocator.protocol.Introspectable).
        self.introspection: Optional[Introspectable] = (
            cast(Introspectable, allocator) if state.caps.introspection else None
        )
        # Its host free set, when it has a host pool and implements the query (HostIntrospectable).
        self.host_introspection: Optional[HostIntrospectable] = (
            allocator
            if state.caps.introspection and state.num_host_blocks and isinstance(allocator, HostIntrospectable)
            else None
        )
        # The operation being checked, as a call a person can read, or what makes that text when a report first
        # asks for it (most operations pass every check, and their labels are never read).
        self._label: Union[str, Callable[[], str]] = "setup"

    @property
    def operation(self) -> str:
        """The operation being checked, as a call a person can read (made now if it was set lazily)."""
        label = self._label
        if not isinstance(label, str):
            label = self._label = label()
        return label

    @operation.setter
    def operation(self, label: Union[str, Callable[[], str]]) -> None:
        """The operation being checked: its text, or what makes it, called only when something reads it."""
        self._label = label

    def counts(self) -> Optional[PoolCounts]:
        """The sizes of the allocator's sets, or None without introspection."""
        alloc = self.introspection
        if alloc is None:
            return None
        host = self.host_introspection
        return PoolCounts(
            len(alloc.free_blocks()),
            len(alloc.cached_blocks()),
            len(alloc.pending_blocks()),
            None if host is None else len(host.host_free_blocks()),
        )

    def pending_now(self) -> set[int]:
        """The blocks the allocator holds pending (none without introspection): what a completing step may settle."""
        alloc = self.introspection
        return set() if alloc is None else set(alloc.pending_blocks())

    def unreferenced_in_inflight_window(self) -> list[int]:
        """Blocks released within the in-flight window and not referenced again: a correct allocator holds
        exactly these pending, and cannot hand them out yet."""
        holders, late = self.state.refs.holders, self.pools.late_work_by_block
        found = [block for block in late if block not in holders]
        found += [block for block in self.pools.held_until if block not in late and block not in holders]
        return found

    def cached_set(self) -> Optional[frozenset[int]]:
        """The allocator's cached (evictable) blocks now, or None without introspection."""
        alloc = self.introspection
        return None if alloc is None else frozenset(alloc.cached_blocks())

    def evicted(self, before: Sequence[int]) -> list[int]:
        """The blocks that left the cached set since ``before`` was taken, in its order (empty without
        introspection)."""
        alloc = self.introspection
        if alloc is None:
            return []
        after = set(alloc.cached_blocks())
        return [block for block in before if block not in after]

    def allocator_table(self, seq: str) -> tuple[int, ...]:
        """The allocator's current table of ``seq``, or of a group table its owner's ``group_block_tables`` entry
        (unchecked: for comparing with what the engine recorded)."""
        model = self.state.seqs[seq]
        if not model.owner:
            return tuple(self.allocator.block_table(seq))
        return tuple(cast(GroupedTables, self.allocator).group_block_tables(model.owner)[model.group])

    def owes_caching(self) -> bool:
        """Whether the allocator declares complete caching and shows its sets (without a sliding window, whose
        dropped blocks a hit may legitimately skip)."""
        caps = self.state.caps
        return caps.complete_caching and self.introspection is not None and caps.sliding_window is None

    def fail(self, invariant: Invariant, summary: str, details: Iterable[str] = (), cause: Cause = UNNAMED) -> NoReturn:
        raise violation(invariant, self.operation, self.pools.next_step, summary, list(details), cause)


class Checker:
    """Base of one invariant's checker: the parts of the shared context it reads, and failing through it."""

    def __init__(self, context: CheckContext) -> None:
        self.context = context  # shared with every other checker of the engine
        self.state = context.state
        self.pools = context.pools
        self.allocator = context.allocator
        self.introspection = context.introspection
        self.host_introspection = context.host_introspection

    def fail(self, invariant: Invariant, summary: str, details: Iterable[str] = (), cause: Cause = UNNAMED) -> NoReturn:
        self.context.fail(invariant, summary, details, cause)
