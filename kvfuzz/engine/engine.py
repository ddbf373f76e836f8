"""The serving engine kvfuzz plays around an allocator: each operation calls the allocator, performs what it orders
(writes, copies, swaps), updates the expected state and the contiguous reference, and has the checks look at what
changed.

The engine knows only the contract, never a particular allocator. The operation table (:mod:`kvfuzz.program`)
drives it for the Hypothesis machine, random programs and replay; the workload scheduler and unit tests drive it
directly through the same methods.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Callable, Optional, Sequence, TypeVar, cast

import attrs

from kvfuzz.accounting.occupancy import Occupancy, measure
from kvfuzz.allocator.errors import AllocatorError, Misuse, OutOfBlocks
from kvfuzz.allocator.protocol import AllocatorProtocol, AsyncLoads, EvictsBlocks, HostCache, HostIntrospectable
from kvfuzz.allocator.types import (
    NULL_BLOCK,
    AdmitResult,
    BlockCopy,
    GrowResult,
    HostTransfers,
    Namespace,
    SeqId,
    SwapResult,
    Tokens,
    group_block_sizes,
)
from kvfuzz.engine.checks import CacheSnapshot, Checks, PoolCounts
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.expected import AsyncLoad, ExpectedState, SeqModel, Status, TableChange, mapped
from kvfuzz.engine.groups import group_namespace
from kvfuzz.engine.matchable import Filled
from kvfuzz.engine.misuse import MisuseCall
from kvfuzz.engine.pools import UNTIL_LOADS_LAND, KVPools, SlotWrite
from kvfuzz.engine.violations import Invariant
from kvfuzz.reference.content import prefix_tags
from kvfuzz.reference.contiguous import ContiguousReference

T = TypeVar("T")


def _fork_copies(result: object) -> object:
    """fork's copies as a tuple (None means every block is shared); anything else is left for the checks to name."""
    if result is None:
        return ()
    return tuple(result) if isinstance(result, list) else result


def _merged(first: TableChange, second: TableChange) -> TableChange:
    """Two table updates of one operation (a sequence's tables in two KV-cache groups) as one."""
    return TableChange(
        first.touched | second.touched, first.released + second.released, first.acquired + second.acquired
    )


_UNCHANGED = TableChange(frozenset(), (), ())


class GeometryMismatch(ValueError):
    """The allocator a factory built does not have the pool geometry kvfuzz asked for."""


class Engine:
    """One example's engine around one allocator: its K/V pools, its expected state, and the checks."""

    def __init__(
        self,
        allocator: AllocatorProtocol,
        config: MachineConfig,
        stats: Optional[Counter[str]] = None,
        on_step: Optional[Callable[[Occupancy], None]] = None,
    ) -> None:
        caps = allocator.capabilities
        mismatch = [
            name
            for name, want in (("block_size", config.block_size), ("num_blocks", config.num_blocks))
            if getattr(allocator, name) != want
        ]
        if mismatch:
            raise GeometryMismatch(f"allocator geometry {mismatch} differs from the machine config {config}")
        try:
            group_block_sizes(caps.kv_groups, config.block_size)
        except ValueError as error:
            raise GeometryMismatch(str(error)) from None
        self.allocator = allocator  # the allocator under test
        self.caps = caps  # what it declares
        self.config = config  # pool geometry, model shape and attention kernel
        # A host pool is swap's destination, a second cache tier the allocator declares (host_cache: loads and
        # stores the engine performs), or one the allocator fills by itself (SGLang's HiCache): one it lists
        # (HostIntrospectable) is checked.
        host_pool = caps.swap or caps.host_cache or (caps.introspection and isinstance(allocator, HostIntrospectable))
        num_host_blocks = allocator.num_host_blocks if host_pool else 0
        self.expected = ExpectedState(
            caps, config.block_size, config.num_blocks, num_host_blocks, ContiguousReference(config.shape)
        )
        # Every physical block gets the rows of the largest group's block (config.block_size without groups).
        self.pools = KVPools(config.shape, self.expected.rows, config.num_blocks, num_host_blocks, caps.inflight_window)
        self.checks = Checks(self.expected, self.pools, allocator, config.kernel)
        # Under kv_groups, the checks of the groups' tables (None otherwise).
        self.group_checks = self.checks.groups
        self.stats: Counter[str] = stats if stats is not None else Counter()  # operations and outcomes, by name
        self.on_step = on_step  # called with the pool's occupancy after every step
        # Under host_cache: loads ordered by admissions since the last launch, (sequence, host block, device block),
        # landed when the next step is launched; and stores in flight, step -> (device block, host block) pairs,
        # landed when that step completes unless flushed first.
        self.host_loads: list[tuple[SeqId, int, int]] = []
        # Under host_cache, the writes of sequences freed since the last launch: that launch makes them, after the
        # flushed stores and the loads (written at once otherwise, since nothing can tell the two orders apart).
        self.aborted_writes: list[tuple[int, SlotWrite]] = []
        self.host_stores: dict[int, list[tuple[int, int]]] = {}

    def close(self) -> None:
        """The example is over: release the K/V pools now rather than when the garbage collector runs."""
        self.pools.close()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def occupancy(self) -> Occupancy:
        """The device pool now: blocks referenced by running sequences (and by those waiting for or after their
        asynchronous loads, filled up to their hit), their fill, sharing, and the allocator's cached, free and pending
        sets where it exposes them."""
        state = self.expected
        # (table id, tokens its table holds) of every sequence and group table holding device blocks.
        holders = [(seq, state.length(seq)) for seq in state.ids(Status.RUNNING, groups=True)]
        for status in (Status.LOADING, Status.LOADED):
            holders += [(seq, state.seqs[seq].covered_tokens or 0) for seq in state.ids(status)]
        running = [(state.seqs[seq].table, tokens) for seq, tokens in holders]
        counts = self.checks.context.counts()
        occupancy = measure(
            self.pools.next_step - 1,
            running,
            state.rows,
            self.config.num_blocks,
            cached_blocks=None if counts is None else counts.cached,
            free_blocks=None if counts is None else counts.free,
            pending_blocks=None if counts is None else counts.pending,
            table_block_sizes=[state.layout(seq).size for seq, _ in holders] if len(state.layouts) > 1 else None,
        )
        # Under kv_groups every group's tables hold blocks, but the sequences are those of group 0.
        return attrs.evolve(occupancy, sequences=len(state.ids(Status.RUNNING))) if self.caps.kv_groups else occupancy

    # -- operations ----------------------------------------------------------------------------------------------

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> bool:
        """A new request; returns whether it was admitted."""
        self._begin("admit", seq, namespace, tokens)
        before = self.checks.eviction_order.snapshot()
        owed = (
            self.checks.complete_caching.owed_hit(prefix_tags(namespace, tokens))
            if self.checks.context.owes_caching()
            else []
        )
        result = self._attempt(
            lambda: self.allocator.admit(seq, namespace, tokens), AdmitResult, self._admit_needs(tokens), absent=seq
        )
        if result is None:
            return False
        self.expected.reference.add(seq, namespace, tokens)
        for group, table_id in zip(self.caps.kv_groups[1:], self.expected.group_tables(seq)):
            self.expected.reference.add(table_id, group_namespace(namespace, group.name), tokens)
        self._admission(seq, result, before, owed)
        return True

    def readmit(self, seq: SeqId) -> bool:
        """A preempted request comes back with every token it had; returns whether it was admitted."""
        reference = self.expected.reference
        namespace, tokens = reference.namespace(seq), tuple(reference.tokens(seq))
        self._begin("readmit", seq)
        before = self.checks.eviction_order.snapshot()
        owed = self.checks.complete_caching.owed_hit(reference.tags(seq)) if self.checks.context.owes_caching() else []
        result = self._attempt(
            lambda: self.allocator.admit(seq, namespace, tokens), AdmitResult, self._admit_needs(tokens), absent=seq
        )
        if result is None:
            return False
        self._admission(seq, result, before, owed)
        return True

    def land_loads(self, seq: SeqId) -> None:
        """Under ``async_loads``: the worker has finished ``seq``'s asynchronous loads (their step completed some
        time ago). The engine performs them now, checks a live sequence's whole hit holds its prefix, and reports
        them to the allocator; a sequence freed while loading lets its blocks go, each leaving the in-flight window
        once its own window (from its release) has closed."""
        self._begin("land_loads", seq)
        load = self.expected.async_loads.pop(seq)
        for host_block, block in load.pairs:
            via = f"loaded asynchronously from host block {host_block} for {seq}"
            self.pools.note(block, via)
            self.pools.swap_from_host(host_block, block, via, step=self.pools.last_completed)
        model = self.expected.seqs.get(seq)
        covered = model.covered_tokens or 0 if model is not None else 0
        positions = [(seq, position) for position in range(covered)]
        if model is not None:
            model.written = covered
        self.checks.content.holds(self.pools.take_dirty(), positions)
        self._call(lambda: cast(AsyncLoads, self.allocator).loads_landed(seq))
        self.stats["asynchronous loads landed"] += 1
        if model is not None:
            model.status = Status.LOADED
            self.checks.accounting.touched(mapped(model.table))
        else:  # its blocks go, but for those another sequence freed while loading still holds until its own report
            held = {block for other in self.expected.async_loads.values() for block in mapped(other.table)}
            self.checks.accounting.touched(
                self.pools.lift([block for block in mapped(load.table) if block not in held])
            )

    def resume(self, seq: SeqId) -> bool:
        """Under ``async_loads``: schedule a sequence whose loads have landed; the allocator allocates the rest of its
        prompt (or refuses, changing nothing) and returns the whole table with the hit its admission reported.
        Returns whether it found room."""
        self._begin("resume", seq)
        model = self.expected.seqs[seq]
        covered = model.covered_tokens or 0
        before = self.checks.eviction_order.snapshot()
        result = self._attempt(
            lambda: cast(AsyncLoads, self.allocator).resume(seq),
            AdmitResult,
            self._blocks(self.expected.length(seq), seq) - len(model.table),
        )
        if result is None:
            return False
        self.checks.cache.resumed_hit(seq, result, covered)
        model.covered_tokens = None
        self._admitted(seq, result.block_table, result.num_cached_tokens, before)
        self.stats["resumed after asynchronous loads"] += 1
        return True

    def grow(self, seq: SeqId, tokens: Tokens) -> bool:
        """Append tokens (decode, a chunk, speculative drafts); returns whether the allocator found room."""
        model = self.expected.seqs[seq]
        old_len = self.expected.length(seq)
        self._begin("grow", seq, tokens)
        needed = sum(
            max(0, self._reach(old_len + len(tokens), table_id) - len(self.expected.seqs[table_id].table))
            + (old_len % self.expected.layout(table_id).size != 0)
            for table_id in (seq, *self.expected.group_tables(seq))
        )
        before = self.checks.eviction_order.snapshot()
        result = self._attempt(lambda: self.allocator.grow(seq, tokens), GrowResult, needed, grown=seq)
        if result is None:
            return False
        for copy in result.copies:
            self.pools.copy_block(copy.src, copy.dst)
            self.stats["copy-on-write copies"] += 1
        for table_id in (seq, *self.expected.group_tables(seq)):
            self.expected.reference.extend(table_id, tokens)
        speculative = self.caps.speculative_tokens
        model.drafts = 0 if speculative is None else min(len(tokens) - 1, speculative)
        old_table = model.table
        table = self._table(seq)
        self.checks.content.grow_slots(seq, result.slots, table, old_len, len(tokens))
        released = f"released by {seq}'s copy-on-write (grow)"
        change = self._set_table(seq, table, "grown into", released)
        change = _merged(change, self._set_group_tables(seq, table, "grown into", released))
        deduplicated = self._deduplicated_copies(seq, result.copies, old_table, old_len)
        self._settle(change)
        if deduplicated:
            self.checks.accounting.touched(copy.dst for copy in deduplicated)
        self.checks.eviction_order.evictions(before, (), reuse=True)
        table_ids = (seq, *self.expected.group_tables(seq))
        for copy in result.copies:
            if copy in deduplicated:
                continue  # wasted work into a block nobody holds: not a write into anyone's block
            holders = {holder for holder, _ in self.expected.refs.holders.get(copy.dst, ())}
            writer = next((table_id for table_id in table_ids if table_id in holders), seq)  # the group it went to
            self.checks.exclusive.block(copy.dst, writer, f"copy-on-write copy from block {copy.src}")
        self.expected.matchable.forget(copy.dst for copy in result.copies)
        for table_id in table_ids:
            self._schedule_writes(table_id, old_len, "grow")
        self.checks.window.outside({copy.dst for copy in result.copies}, seq)
        return True

    def _deduplicated_copies(
        self, seq: SeqId, copies: Sequence[BlockCopy], old_table: tuple[int, ...], old_len: int
    ) -> list[BlockCopy]:
        """Under ``dedupes_copied_tail``: the copies whose destination ``seq``'s table does not map after its grow,
        each checked (a copy of the partial tail the grow filled, into a block left unreferenced and uncached, while
        the table maps a block holding the same K/V) and released as wasted work."""
        if not self.caps.dedupes_copied_tail:
            return []
        table = self.expected.seqs[seq].table
        deduplicated = []
        for copy in copies:
            if copy.dst in table:
                continue
            index = self.checks.exclusive.copy_deduplicated(seq, copy, old_table, old_len)
            self.checks.content.deduplicated_tail(seq, index, copy.dst)
            self.pools.note(
                copy.dst, f"copy-on-write destination dropped by {seq}'s grow, its table mapping block {table[index]}"
            )
            self.pools.release(copy.dst, seq)
            deduplicated.append(copy)
            self.stats["copy-on-write copies deduplicated"] += 1
        return deduplicated

    def fork(self, parent: SeqId, child: SeqId) -> bool:
        """Parallel sampling or beam search: ``child`` shares all of ``parent``'s blocks, or gets the copies the
        allocator returned (then its table differs from the parent's exactly at their destinations)."""
        state = self.expected
        self._begin("fork", parent, child)
        needed = int(self.caps.fork_copies and state.length(parent) % state.layout(parent).size != 0)
        needed += self.caps.lookahead_blocks  # the child may get look-ahead blocks of its own
        before = self.checks.eviction_order.snapshot()
        # Checked as a tuple of BlockCopy by the result check before it is used as one.
        copies = cast(
            Optional[tuple[BlockCopy, ...]],
            self._attempt(lambda: _fork_copies(self.allocator.fork(parent, child)), tuple, needed, absent=child),
        )
        if copies is None:
            return False
        self.checks.accounting.fork_copies_declared(parent, child, copies)
        self.expected.matchable.forget(copy.dst for copy in copies)
        for copy in copies:
            self.pools.copy_block(copy.src, copy.dst)
            self.stats["fork copies"] += 1
        state.reference.fork(parent, child)
        parent_table = state.seqs[parent].table
        state.seqs[child] = SeqModel(
            child, Status.RUNNING, written=state.seqs[parent].written, joined_step=self.pools.next_step
        )
        table = self._table(child)
        moved_to = {copy.src: copy.dst for copy in copies}
        filled = parent_table[: state.num_blocks_for(parent)]
        self.checks.accounting.fork_table(parent, child, tuple(moved_to.get(block, block) for block in filled), table)
        layout, written = state.layout(child), state.seqs[child].written
        moved = [index for index, (old, new) in enumerate(zip(parent_table, table)) if old != new]
        change = self._set_table(child, table, "shared by fork with")
        for parent_id, child_id in zip(state.group_tables(parent), state.group_tables(child)):
            state.reference.fork(parent_id, child_id)
            parent_model = state.seqs[parent_id]
            state.seqs[child_id] = SeqModel(
                child_id,
                Status.RUNNING,
                written=written,
                joined_step=self.pools.next_step,
                group=parent_model.group,
                owner=child,
            )
        if self.group_checks is not None:
            for parent_id, child_id, group_table in zip(
                state.group_tables(parent), state.group_tables(child), self.group_checks.tables(child, table)
            ):
                self.checks.results.table_shape(child_id, group_table)
                filled = state.seqs[parent_id].table[: state.num_blocks_for(parent)]
                self.checks.accounting.fork_table(parent_id, child_id, filled, group_table)
                change = _merged(change, self._set_table(child_id, group_table, "shared by fork with"))
        self._settle(
            change,
            [
                (child, p)
                for index in moved
                for p in range(layout.first_position(index), min(layout.first_position(index + 1), written))
            ],
        )
        self.checks.eviction_order.evictions(before, (), reuse=True)
        for copy in copies:
            self.checks.exclusive.block(copy.dst, child, f"fork copy from block {copy.src}")
        self.checks.window.outside({copy.dst for copy in copies}, child)
        return True

    def free(self, seq: SeqId, *, run_ends: bool = False) -> None:
        """The request finished or was cancelled (possibly before its first step).

        Under ``free_lands_scheduled_writes`` the step its tokens were scheduled for runs in full, abort or not: their
        writes land first. Otherwise they are withdrawn with it, which no other sequence may have hit, unless the
        run ends (``run_ends``: every sequence goes, and nothing reads again)."""
        state = self.expected
        self._begin("free", seq)
        if state.seqs[seq].status is Status.RUNNING:
            if self.caps.free_lands_scheduled_writes and self.caps.kv_groups:
                for table_id in (seq, *state.group_tables(seq)):
                    slots, writes = self._take_scheduled_writes(table_id, "scheduled before the abort")
                    if slots:
                        self.pools.write(slots, writes)
            elif self.caps.free_lands_scheduled_writes:
                slots, writes = self._take_scheduled_writes(seq, "scheduled before the abort")
                if self.caps.host_cache:
                    self.aborted_writes += zip(slots, writes)
                    state.aborted_tags.update((slot, write.tag) for slot, write in zip(slots, writes))
                    if slots:  # the step that makes them reads every block of the table until it completes
                        until = self.pools.last_completed + self.caps.inflight_window + 1
                        for block in mapped(state.seqs[seq].table):
                            self.pools.read_until[block] = max(self.pools.read_until.get(block, -1), until)
                elif slots:
                    self.pools.write(slots, writes)
            elif not run_ends:
                for table_id in (seq, *state.group_tables(seq)):
                    self.checks.cache.withdrawn_writes_unread(table_id, f"free({seq!r})")
            self._hold_loading(seq)
        elif seq in state.async_loads:
            self._hold_until_landed(seq)
        self._call(lambda: self.allocator.free(seq))
        change = self._set_table(seq, (), "released (free) by")
        for table_id in state.group_tables(seq):
            change = _merged(change, self._set_table(table_id, (), "released (free) by"))
            self._forget(table_id)
        host_table = mapped(state.seqs[seq].host_table)
        state.matchable.cancel(seq)
        del state.seqs[seq]
        state.retire(seq)
        state.reference.remove(seq)
        state.finished.append(seq)
        self._settle(change)
        if host_table:
            self.checks.accounting.host_accounting(host_table, released_by=f"free({seq!r}) of a swapped-out sequence")

    def preempt(self, seq: SeqId) -> None:
        """Release a running sequence for recomputation; it keeps its tokens and waits to be readmitted."""
        self._begin("preempt", seq)
        table_ids = (seq, *self.expected.group_tables(seq))
        for table_id in table_ids:
            self.checks.cache.withdrawn_writes_unread(table_id, f"preempt({seq!r})")
        self._hold_loading(seq)
        self._call(lambda: self.allocator.preempt(seq))
        change = _UNCHANGED
        for table_id in table_ids:
            change = _merged(change, self._set_table(table_id, (), "released (preempt) by"))
            model = self.expected.seqs[table_id]
            model.status, model.written, model.drafts = Status.PREEMPTED, 0, 0
        self.expected.matchable.cancel(seq)
        self._settle(change)

    def swap_out(self, seq: SeqId) -> bool:
        """Move a running sequence's K/V to the host pool."""
        state = self.expected
        model = state.seqs[seq]
        self._begin("swap_out", seq)
        live = mapped(model.table)
        result = self._attempt(lambda: self.allocator.swap_out(seq), SwapResult, len(live), host=True)
        if result is None:
            return False
        held = state.host_holders()
        self.checks.content.swap_out_mapping(seq, result.mapping, model.table, held)
        shared = sum(host_block in held for _, host_block in result.mapping)
        if shared:
            self.stats["host blocks shared at swap-out"] += shared
        for block, host_block in result.mapping:
            self.pools.swap_to_host(block, host_block)
        host_of = dict(result.mapping)
        host_table = tuple(host_of.get(block, NULL_BLOCK) for block in model.table)
        change = self._set_table(seq, (), "released (swap-out) by")
        state.matchable.cancel(seq)
        model.status, model.host_table = Status.SWAPPED, host_table
        self.stats["swapped out blocks"] += len(live)
        self._settle(change)
        self.checks.accounting.host_accounting(host_of.values())
        return True

    def swap_in(self, seq: SeqId) -> bool:
        """Bring a swapped-out sequence back to the device."""
        state = self.expected
        model = state.seqs[seq]
        self._begin("swap_in", seq)
        before = self.checks.eviction_order.snapshot()
        result = self._attempt(lambda: self.allocator.swap_in(seq), SwapResult, len(mapped(model.host_table)))
        if result is None:
            return False
        self.checks.content.swap_in_mapping(seq, result.mapping, model.host_table)
        self.expected.matchable.forget(block for _, block in result.mapping)
        for host_block, block in result.mapping:
            self.pools.swap_from_host(host_block, block)
        host_table = mapped(model.host_table)
        model.status, model.host_table, model.joined_step = Status.RUNNING, (), self.pools.next_step
        table = self._table(seq)
        change = self._set_table(seq, table, "swapped in for")
        self._settle(
            change, positions=[(seq, position) for position in range(state.sliding_window_start(seq), model.written)]
        )
        self.checks.eviction_order.evictions(before, (), reuse=True)
        for _, block in result.mapping:
            self.checks.exclusive.block(block, seq, "swap-in copy")
        self.checks.window.outside({block for _, block in result.mapping}, seq)
        self.checks.accounting.host_accounting(host_table, released_by=f"swap_in({seq!r})")
        self.stats["swapped in blocks"] += len(result.mapping)
        return True

    def rollback(self, seq: SeqId, num_tokens: int) -> None:
        """Drop the last tokens (rejected speculative drafts)."""
        state = self.expected
        self._begin("rollback", seq, num_tokens)
        self._call(lambda: self.allocator.rollback(seq, num_tokens))
        model = state.seqs[seq]
        old_len = state.length(seq)
        new_len = old_len - num_tokens
        state.reference.truncate(seq, new_len)
        model.written = min(model.written, new_len)
        state.matchable.cancel(seq, new_len // state.layout(seq).size)
        model.drafts = max(0, model.drafts - num_tokens)
        table = self._table(seq)
        self.checks.content.rollback_table(seq, model.table, table)
        released = f"released by {seq}'s rollback of {num_tokens} token(s), to length {new_len}"
        self._settle(self._set_table(seq, table, "after rollback, given to", released, held_tokens=old_len))

    def evict(self, num_blocks: int) -> None:
        """Ask the allocator to drop up to ``num_blocks`` cached, unreferenced blocks (at least that many, or every
        cached one, under ``evict_rounds_up``)."""
        self._begin("evict", num_blocks)
        introspection = self.checks.context.introspection
        before = list(introspection.cached_blocks()) if introspection is not None else []
        order_before = self.checks.eviction_order.snapshot()
        dropped = self._call(lambda: self.allocator.evict(num_blocks))
        self.checks.results.result(f"evict({num_blocks})", dropped, int)
        evicted = self.checks.context.evicted(before)
        self.checks.accounting.evict_count(num_blocks, dropped, before, evicted)
        self.stats["evicted blocks"] += dropped
        self._evicted(evicted, f"evict({num_blocks})")
        self.checks.eviction_order.evictions(order_before, (), reuse=False)

    def evict_blocks(self, blocks: tuple[int, ...]) -> None:
        """Ask the allocator to drop these unreferenced blocks from its cache (those it caches; the others stay as
        they are): none may be matched again until a table maps it anew."""
        self._begin("evict_blocks", list(blocks))
        introspection = self.checks.context.introspection
        before = list(introspection.cached_blocks()) if introspection is not None else []
        self._call(lambda: cast(EvictsBlocks, self.allocator).evict_blocks(blocks))
        if introspection is not None:
            self.checks.accounting.evict_targets(blocks, before, self.checks.context.evicted(before))
        self._evicted(blocks, f"evict_blocks({list(blocks)})")

    def reset_cache(self) -> None:
        """Ask the allocator to drop every cached, unreferenced block: none of the unreferenced blocks outside the
        in-flight window (and not held pending) may be matched again until a table maps it anew."""
        self._begin("reset_cache")
        self._call(self.allocator.reset_cache)
        self.checks.accounting.cache_empty()
        # A block in flight, or one the allocator may hold pending, may be cached again once released from that.
        held = self.pools.late_work_by_block.keys() | self.pools.held_until.keys()
        self._evicted([block for block in self.expected.refs.released if block not in held], "reset_cache()")

    def step(self) -> int:
        """One forward pass: write the K/V of every new token, then every running sequence attends."""
        self._begin("step")
        step = self.pools.next_step
        slots: list[int] = []
        writes: list[SlotWrite] = []
        for seq in self.expected.ids(Status.RUNNING, groups=True):
            if self.checks.context.owes_caching():
                self._note_filled(seq, step)
            seq_slots, seq_writes = self._take_scheduled_writes(seq)
            slots += seq_slots
            writes += seq_writes
        if self.caps.host_cache:
            self._host_transfers(step)
            slots[:0] = [slot for slot, _ in self.aborted_writes]
            writes[:0] = [write for _, write in self.aborted_writes]
            self.aborted_writes.clear()
            self.expected.aborted_tags.clear()
        self.pools.launch_step()
        if slots:
            self.pools.write(slots, writes)
        for model in self.expected.seqs.values():
            model.awaits_step = False
        self.stats["tokens written"] += len(slots)
        self.checks.content.holds(self.pools.take_dirty())
        self.checks.attention.check()
        self._complete(self.pools.steps_to_complete())
        if self.on_step is not None:
            self.on_step(self.occupancy())
        return step

    def misuse(self, call: MisuseCall) -> None:
        """A call that breaks the contract: it must raise a Misuse error and change nothing."""
        self._begin("misuse", call)
        before = self.checks.context.counts()
        try:
            getattr(self.allocator, call.op)(*call.args)
        except Misuse as error:
            self.checks.refusals.unchanged(Invariant.MISUSE, before, error)
        except Exception as error:  # noqa: BLE001 -- any other exception type is the finding
            self.checks.refusals.misuse_refused_untyped(call, error)
        else:
            self.checks.refusals.misuse_accepted(call)

    def dismiss(self, seq: SeqId, *, run_ends: bool = False) -> None:
        """The engine is done with ``seq`` wherever it is (cancelled, or the run ends: ``run_ends``): a preempted
        sequence holds no blocks and is forgotten without calling the allocator; any other is freed."""
        state = self.expected
        if state.seqs[seq].status is Status.PREEMPTED:
            for table_id in state.group_tables(seq):
                self._forget(table_id)
            del state.seqs[seq]
            state.retire(seq)
            state.reference.remove(seq)
        else:
            self.free(seq, run_ends=run_ends)

    def quiesce(self) -> None:
        """Invariant 10: once every sequence is gone and the in-flight work done, every block is free."""
        for seq in [seq for seq, model in self.expected.seqs.items() if not model.owner]:
            self.dismiss(seq, run_ends=True)
        self._begin("quiesce")
        self._complete(self.pools.steps_to_complete(drain=True))
        while self.pools.late_work_by_block or self.pools.held_until or self.host_loads or self.expected.async_loads:
            if self.caps.host_cache:  # a launch lands the loads still ordered, as the worker would
                self._host_transfers(self.pools.next_step)
            self.pools.launch_step()
            self._complete(self.pools.steps_to_complete(drain=True))
            operation = self.checks.context.operation
            for seq in self.expected.landable_ids():  # the worker reports every asynchronous load
                self.land_loads(seq)
            self.checks.context.operation = operation
        if self.caps.eviction:
            self._call(self.allocator.reset_cache)
        if self.checks.context.introspection is not None:
            self.checks.accounting.touched(())
            self.checks.quiescence.quiescent()
        else:
            self.checks.quiescence.whole_pool_admissible(self.expected.new_id())

    # -- the engine's side of each operation ---------------------------------------------------------------------

    def _begin(self, op: str, *args: object) -> None:
        shown = ", ".join(str(arg) if isinstance(arg, MisuseCall) else repr(arg) for arg in args)
        self.checks.context.operation = f"{op}({shown})"
        self.stats[op] += 1

    def _blocks(self, num_tokens: int, table_id: SeqId) -> int:
        """How many blocks ``num_tokens`` tokens fill in ``table_id``'s table (a sequence's, or one group's)."""
        return self.expected.layout(table_id).blocks_for(num_tokens)

    def _reach(self, num_tokens: int, table_id: SeqId) -> int:
        """The most blocks ``table_id``'s table may hold for ``num_tokens`` tokens: those they fill, and the
        look-ahead."""
        return self._blocks(num_tokens, table_id) + self.caps.lookahead_blocks

    def _admit_needs(self, tokens: Tokens) -> int:
        """The most blocks an admission of ``tokens`` may need: a table's reach in every KV-cache group."""
        return sum(layout.blocks_for(len(tokens)) + self.caps.lookahead_blocks for layout in self.expected.layouts)

    def _call(self, call: Callable[[], T]) -> T:
        """Run an operation that may not be refused."""
        try:
            return call()
        except AllocatorError as error:
            self.checks.refusals.valid_call_refused(error, out_of_blocks_allowed=False)

    def _attempt(
        self,
        call: Callable[[], T],
        result_type: type,
        needed: int,
        absent: Optional[SeqId] = None,
        host: bool = False,
        grown: Optional[SeqId] = None,
    ) -> Optional[T]:
        """Run an operation that may be refused for lack of space; check its result is well formed, and that a
        refusal is clean and justified (``grown``: the sequence a ``grow`` grows, whose out-of-window blocks a
        refusal may drop under ``refusal_drops_window``)."""
        before = self.checks.context.counts()
        cached_before = self.checks.context.cached_set() if self.caps.refusal_evicts else None
        try:
            result = call()
        except OutOfBlocks as error:
            self.stats["refused (out of blocks)"] += 1
            if grown is not None and self.caps.refusal_drops_window:
                before = self._refusal_drops(grown, before, error)
            evicted = self.checks.refusals.unchanged(Invariant.ATOMIC_REFUSAL, before, error, absent, cached_before)
            for block in evicted:
                self.pools.note(block, f"evicted from the cache by the refused {self.checks.context.operation}")
                self.stats["evicted blocks (refusals)"] += 1
            self.checks.refusals.not_false(needed, error, host)
            return None
        except AllocatorError as error:
            self.checks.refusals.valid_call_refused(error, out_of_blocks_allowed=True)
        self.checks.results.result(self.checks.context.operation, result, result_type)
        return result

    def _refusal_drops(self, seq: SeqId, before: Optional[PoolCounts], error: OutOfBlocks) -> Optional[PoolCounts]:
        """Under ``refusal_drops_window``: record the blocks a refused grow of ``seq`` dropped out of its next
        token's window (each changed entry must be such a drop), released as a successful grow releases them;
        returns the pool counts the refusal must otherwise leave as they were."""
        state = self.expected
        table_ids = (seq, *state.group_tables(seq))
        found = {table_id: self.checks.context.allocator_table(table_id) for table_id in table_ids}
        for table_id in table_ids:
            self.checks.refusals.only_drops(table_id, found[table_id], error)
        if all(found[table_id] == state.seqs[table_id].table for table_id in table_ids):
            return before
        for table_id in table_ids:
            state.seqs[table_id].dropped_at_length = state.length(seq)
        table = self._table(seq)
        released = f"dropped out of {seq}'s next window by its refused grow"
        change = self._set_table(seq, table, "kept by", released)
        change = _merged(change, self._set_group_tables(seq, table, "kept by", released))
        self._settle(change)
        self.stats["blocks dropped by refused grows"] += len(change.released)
        return self.checks.refusals.with_released(before, change.released)

    def _evicted(self, blocks: Sequence[int], by: str) -> None:
        """``blocks`` left the cache: note it in their histories, remember it for the cache-soundness check, and
        check the pool's sets around them."""
        step = self.pools.next_step
        self.expected.matchable.forget(blocks)
        for block in blocks:
            self.pools.note(block, f"evicted from the cache ({by})")
            self.expected.evicted[block] = f"{by} while step {step} was being scheduled"
        self._settle(TableChange(frozenset(blocks), (), ()))

    def _table(self, seq: SeqId) -> tuple[int, ...]:
        table = self.checks.results.block_table(seq, self.allocator.block_table(seq))
        self.checks.results.table_shape(seq, table)
        return table

    def _take_scheduled_writes(self, seq: SeqId, via: str = "") -> tuple[list[int], list[SlotWrite]]:
        """The slots and writes of ``seq``'s scheduled tokens, each checked exclusive, and mark them written."""
        state = self.expected
        step = self.pools.next_step
        tags, namespace = state.reference.tags(seq), state.reference.namespace(seq)
        slots, writes = [], []
        for position, slot in state.scheduled_writes(seq):
            self.checks.exclusive.block(slot // state.rows, seq, f"step {step} writes {seq} position {position}")
            slots.append(slot)
            writes.append(SlotWrite(tags[position], seq, namespace, position, step, via))
        state.seqs[seq].written = len(tags)
        return slots, writes

    def _admitted(
        self,
        seq: SeqId,
        reported: Sequence[int],
        num_cached: int,
        before: Optional[CacheSnapshot] = None,
        owed: Sequence[tuple[int, str]] = (),
        loads: Sequence[tuple[int, int]] = (),
    ) -> None:
        model = self.expected.seqs.setdefault(seq, SeqModel(seq, Status.RUNNING))
        model.joined_step = self.pools.next_step
        model.status, model.written, model.drafts = Status.RUNNING, num_cached, 0
        model.dropped_at_length = -1
        table = self._table(seq)
        self.checks.content.admit_table(seq, tuple(reported), table)
        table_ids = (seq, *self.expected.group_tables(seq))
        for group, table_id in enumerate(table_ids[1:], start=1):
            member = self.expected.seqs.setdefault(table_id, SeqModel(table_id, Status.RUNNING, group=group, owner=seq))
            member.status, member.written, member.joined_step = Status.RUNNING, num_cached, model.joined_step
            member.dropped_at_length = -1
        loaded = {block for _, block in loads}  # a host-tier load refills these: their old content is not read
        group_tables = self._group_tables(seq, table)
        for table_id, read in ((seq, table), *group_tables):
            self._hit_not_evicted(table_id, read, num_cached, loaded)
        change = self._set_table(seq, table, "admitted as", hit_tokens=num_cached)
        for table_id, read in group_tables:
            change = _merged(change, self._set_table(table_id, read, "admitted as", hit_tokens=num_cached))
        if self.group_checks is not None:
            self.group_checks.one_group(change.touched)
        self.checks.accounting.touched(change.touched)
        if loads:
            self.checks.cache.host_loads(seq, loads, num_cached)
            self.checks.window.outside([block for _, block in loads], seq)
            self.host_loads += [(seq, host_block, block) for host_block, block in loads]
            self.stats["host-tier loads"] += len(loads)
        loading = {block for _, _, block in self.host_loads}
        awaits = bool(loads)
        if self.group_checks is not None:
            self.group_checks.hit_aligned(seq, num_cached)
        for table_id in table_ids:
            if self.group_checks is not None:
                self.group_checks.hit_window(table_id, num_cached)
            awaits = self.checks.cache.cache_hit(table_id, num_cached, loading) or awaits
        model.awaits_step = awaits
        self.checks.complete_caching.missed_hit(seq, num_cached, owed)
        hit_blocks = [
            block
            for table_id, read in ((seq, table), *group_tables)
            for block in read[: self.expected.layout(table_id).blocks_for(num_cached)]
        ]
        self.checks.eviction_order.evictions(before, hit_blocks, reuse=True)
        # A whole-prompt hit passes only under recomputes_last_token: the engine writes the last token again.
        for table_id in table_ids:
            self.expected.seqs[table_id].written = min(num_cached, self.expected.length(seq) - 1)
            self._schedule_writes(table_id, model.written, "admit")
        if num_cached:
            self.stats["cache hits"] += 1
            self.stats["cache-hit tokens"] += num_cached
        self.checks.content.holds(self.pools.take_dirty())

    def _admission(
        self, seq: SeqId, result: AdmitResult, before: Optional[CacheSnapshot], owed: Sequence[tuple[int, str]]
    ) -> None:
        """An admission (or readmission) the allocator accepted: one that waits for its loads, or one that runs."""
        if result.waits_for_loads:
            self._loading(seq, result, before, owed)
        else:
            self._admitted(seq, result.block_table, result.num_cached_tokens, before, owed, result.loads)

    def _loading(
        self, seq: SeqId, result: AdmitResult, before: Optional[CacheSnapshot], owed: Sequence[tuple[int, str]]
    ) -> None:
        """Under ``async_loads``: an admission waiting for its loads. Its table covers the hit alone; the hit's blocks
        that no load fills must hold the prefix now, and the loaded ones are checked when the loads land."""
        num_cached = result.num_cached_tokens
        self.checks.results.waits_for_loads(seq, result)
        model = self.expected.seqs.setdefault(seq, SeqModel(seq, Status.LOADING))
        model.status, model.written, model.drafts, model.covered_tokens = Status.LOADING, 0, 0, num_cached
        model.joined_step, model.dropped_at_length = self.pools.next_step, -1
        table = self._table(seq)
        self.checks.content.admit_table(seq, tuple(result.block_table), table)
        loaded = {block for _, block in result.loads}
        self._hit_not_evicted(seq, table, num_cached, loaded)
        change = self._set_table(seq, table, "admitted (waiting for its loads) as", hit_tokens=num_cached)
        self.checks.accounting.touched(change.touched)
        self.checks.cache.host_loads(seq, result.loads, num_cached)
        self.checks.window.outside(loaded, seq)
        self.checks.cache.cache_hit(seq, num_cached, loaded)
        self.checks.complete_caching.missed_hit(seq, num_cached, owed)
        self.checks.eviction_order.evictions(before, table, reuse=True)
        self.expected.async_loads[seq] = AsyncLoad(result.loads, table)
        self.stats["host-tier loads"] += len(result.loads)
        self.stats["admissions waiting for their loads"] += 1
        self.stats["cache hits"] += 1
        self.stats["cache-hit tokens"] += num_cached
        self.checks.content.holds(self.pools.take_dirty())

    def _hit_not_evicted(self, seq: SeqId, table: tuple[int, ...], num_cached: int, loaded: set[int]) -> None:
        """Invariant 9: the hit of ``num_cached`` tokens covers no block of ``seq``'s new ``table`` (a sequence's, or
        one group's) that an eviction dropped, unless a host-tier load (``loaded``) refills it."""
        evicted = self.expected.evicted
        hit_blocks = table[: self.expected.layout(seq).blocks_for(num_cached)]
        stale = {
            index: evicted[block] for index, block in enumerate(hit_blocks) if block in evicted and block not in loaded
        }
        if stale:
            self.checks.cache.hit_on_evicted(seq, num_cached, table, stale)

    def _schedule_writes(self, seq: SeqId, first_position: int, op: str) -> None:
        """The next step writes ``seq``'s table (a sequence's, or one group's) from ``first_position`` on: each block
        it writes is no longer matchable, is ``seq``'s alone and is outside the in-flight window."""
        targets = self._write_targets(seq, self.expected.seqs[seq].table, first_position)
        self.expected.matchable.forget(targets.values())
        for index, block in targets.items():
            self.checks.exclusive.block(block, seq, f"{op} schedules writes of {seq}'s logical block {index}")
        self.checks.window.outside(targets.values(), seq)

    def _set_group_tables(
        self, seq: SeqId, table: tuple[int, ...], event: str, released: str = "", hit_tokens: int = 0
    ) -> TableChange:
        """Under ``kv_groups``: read and record ``seq``'s tables in groups 1 onwards (``table`` is group 0's, just
        read)."""
        change = _UNCHANGED
        for table_id, group_table in self._group_tables(seq, table):
            change = _merged(change, self._set_table(table_id, group_table, event, released, hit_tokens))
        return change

    def _group_tables(self, seq: SeqId, table: tuple[int, ...]) -> list[tuple[SeqId, tuple[int, ...]]]:
        """Under ``kv_groups``: (group table id, table read now) of ``seq``'s groups 1 onwards, each checked well
        formed and shaped as a table of its own (``table`` is group 0's, just read); [] otherwise."""
        if self.group_checks is None:
            return []
        read = list(zip(self.expected.group_tables(seq), self.group_checks.tables(seq, table)))
        for table_id, group_table in read:
            self.checks.results.table_shape(table_id, group_table)
        return read

    def _forget(self, table_id: SeqId) -> None:
        """A group table leaves with its sequence (freed, or dismissed while preempted)."""
        state = self.expected
        state.matchable.cancel(table_id)
        del state.seqs[table_id]
        state.retire(table_id)
        state.reference.remove(table_id)

    def _write_targets(self, seq: SeqId, table: tuple[int, ...], first_position: int) -> dict[int, int]:
        """Logical index -> block of every block the next step writes, from ``first_position`` on (dropped
        entries are never written)."""
        return {
            index: table[index]
            for index in range(self.expected.layout(seq).index(first_position), len(table))
            if table[index] != NULL_BLOCK
        }

    def _set_table(
        self,
        seq: SeqId,
        table: tuple[int, ...],
        event: str,
        released: str = "",
        hit_tokens: int = 0,
        reuses_cached: bool = False,
        held_tokens: Optional[int] = None,
    ) -> TableChange:
        """Record ``seq``'s new table; released blocks start their in-flight window. Each block's history notes the
        ``event`` that gave it to ``seq`` (the entries an admission's ``hit_tokens`` cover as a cache hit; a block last
        seen cached and handed out otherwise as evicted first, unless the event ``reuses_cached`` content) and, for a
        released one, ``released`` (or ``event``). ``held_tokens``: how many tokens the old table held (its length
        now, unless a rollback just dropped some), which tells its look-ahead entries apart."""
        state = self.expected
        model = state.seqs[seq]
        hit_blocks = state.layout(seq).blocks_for(hit_tokens)
        old = model.table
        change = state.refs.replace(seq, old, table)
        for block in change.acquired:
            state.evicted.pop(block, None)
        model.table = table
        pools = self.pools
        for index, block in enumerate(table):
            if index < len(old) and old[index] == block:
                continue
            if index < hit_blocks:
                pools.note(block, f"matched by {seq}'s cache hit as its logical block {index}")
                continue
            if block in pools.seen_cached and not reuses_cached:
                pools.note(block, "evicted from the cache, to be reused")
                pools.seen_cached.discard(block)
            pools.note(block, f"{event} {seq} as logical block {index}")
        for block in change.released:
            pools.note(block, released or f"{event} {seq}")
            pools.release(block, seq)
        if self.caps.lookahead_blocks:
            held = self._blocks(state.length(seq) if held_tokens is None else held_tokens, seq)
            for index in range(self._blocks(state.length(seq), seq) if table else held, min(held, len(table))):
                pools.note(table[index], f"kept as look-ahead by {seq} (logical block {index})")
            state.released_lookahead |= {block for block in old[held:] if block in change.released}
            state.released_lookahead -= set(change.acquired)
            if table:
                self.checks.exclusive.lookahead_exclusive(seq, hit_tokens)
            self.checks.cache.lookahead_not_cached()
        if self.checks.context.owes_caching():
            for block in change.released:
                self.checks.complete_caching.released_matchable(block)
        return change

    def _host_transfers(self, step: int) -> None:
        """Under ``host_cache``, as ``step`` is launched: the allocator's transfer order, then the flushed stores and
        the loads land (in that order, as vLLM's worker flushes before it loads), each load checked for content."""
        transfers = self._call(functools.partial(cast(HostCache, self.allocator).take_transfers, step))
        self.checks.results.result(f"take_transfers({step})", transfers, HostTransfers)
        stores = list(transfers.stores)
        in_flight = [pair for pairs in self.host_stores.values() for pair in pairs] + stores
        self.checks.results.host_transfers(step, transfers, in_flight)
        for pair in transfers.flushed:
            for pairs in (*self.host_stores.values(), stores):
                if pair in pairs:
                    pairs.remove(pair)
                    break
            self._land_store(pair, f"flushed before step {step}")
        positions: list[tuple[SeqId, int]] = []
        for seq, host_block, block in self.host_loads:
            self.pools.note(block, f"loaded from host block {host_block} for {seq}")
            self.pools.swap_from_host(host_block, block, f"loaded from host block {host_block} for {seq}")
            model = self.expected.seqs.get(seq)
            if model is not None and model.status is Status.RUNNING and block in model.table:
                index, size = model.table.index(block), self.expected.layout(seq).size
                positions += [(seq, p) for p in range(index * size, min((index + 1) * size, model.written))]
        self.host_loads.clear()
        for load in self.expected.async_loads.values():
            if load.launched_at is None:
                load.launched_at = step  # the worker starts them now; they land when the engine reports them
        self.checks.content.holds(self.pools.take_dirty(), positions)
        if stores:
            self.host_stores.setdefault(step, []).extend(stores)
        self.stats["host-tier stores"] += len(transfers.stores)
        self._check_host_in_use()

    def _check_host_in_use(self) -> None:
        """Under ``host_cache``, where the allocator lists its host free set: no host block a transfer still uses (a
        store in flight writing it, an asynchronous load not yet reported reading it) is in that set. Nothing is
        gathered when there is no set to check it against (every launch and completed step passes here)."""
        if self.checks.context.host_introspection is None:
            return
        in_use = {
            host_block: f"the store of block {block} into it, ordered at the launch of step {step}, is in flight"
            for step, pairs in self.host_stores.items()
            for block, host_block in pairs
        }
        for seq, load in self.expected.async_loads.items():
            for host_block, block in load.pairs:
                in_use[host_block] = f"the asynchronous load of {seq} from it into block {block} is not reported landed"
        self.checks.accounting.host_transfers_unfree(in_use)

    def _hold_loading(self, seq: SeqId) -> None:
        """Under ``host_cache``, before ``seq`` releases its table: a block that a load ordered since the last launch
        still fills stays in flight until the next step to complete has completed, which comes after the next
        launch lands the load (under W = 0 it is the step of that launch): the allocator may hold it pending until
        then, as one that acknowledges the load when its step completes does, and must not hand it out before. The
        blocks of the prefix such a load extends (its table before the loaded block) may be held pending until then
        too, as a tree cache keeps a loaded node's ancestors resident, but may be handed out: no load writes them."""
        loading = {block for _, _, block in self.host_loads}
        until = self.pools.last_completed + 1
        table = self.expected.seqs[seq].table
        last_loaded = max((index for index, block in enumerate(table) if block in loading), default=-1)
        for block in mapped(table[: last_loaded + 1]):
            if block in loading:
                self.pools.read_until[block] = max(self.pools.read_until.get(block, -1), until)
            else:  # the prefix the load extends, which a tree cache keeps resident until it acknowledges the load
                self.pools.held_until[block] = max(self.pools.held_until.get(block, -1), until)

    def _hold_until_landed(self, seq: SeqId) -> None:
        """Under ``async_loads``, before a loading sequence releases its table: the blocks its loads fill stay in
        flight until the engine reports those loads landed (the worker still writes them); the rest of its table may
        be held pending until then (vLLM frees a loading request's blocks only once its loads are done), but may be
        handed out."""
        load = self.expected.async_loads[seq]
        loading = {block for _, block in load.pairs}
        for block in mapped(load.table):
            if block in loading:
                self.pools.read_until[block] = UNTIL_LOADS_LAND
            else:
                self.pools.held_until[block] = UNTIL_LOADS_LAND

    def _land_store(self, pair: tuple[int, int], when: str) -> None:
        block, host_block = pair
        self.pools.note(block, f"stored into host block {host_block} ({when})")
        self.pools.swap_to_host(block, host_block, f"stored from block {block} ({when})")

    def _settle(self, change: TableChange, positions: Sequence[tuple[SeqId, int]] = ()) -> None:
        """After an operation: content of what it touched, then (under ``kv_groups``) one group per block, then
        refcounts and the free set."""
        self.checks.content.holds(self.pools.take_dirty(), positions)
        if self.group_checks is not None:
            self.group_checks.one_group(change.touched)
        self.checks.accounting.touched(change.touched)

    def _note_filled(self, seq: SeqId, step: int) -> None:
        """Complete caching: the full blocks of ``seq`` that step ``step`` fills are owed matchable once the step
        its writes were scheduled for has surely completed (step c + W + 1, c the last completed now). A block that
        holds drafts of the latest grow is not: a rollback may still reject them, and an allocator caches only
        verified tokens (vLLM's ``allocate_slots`` caches up to ``request.num_tokens``, never a draft)."""
        model, size = self.expected.seqs[seq], self.expected.layout(seq).size
        due = self.pools.last_completed + self.caps.inflight_window + 1
        tags = self.expected.reference.tags(seq)
        for index in range(model.written // size, (len(tags) - model.drafts) // size):
            block = model.table[index]
            if block != NULL_BLOCK:
                written = f"{seq} as its logical block {index} at step {step}"
                self.expected.matchable.fill(Filled(due, seq, index, block, tags[(index + 1) * size - 1], written))

    def _owe_filled(self, step: int) -> None:
        """The blocks filled in time for ``step``'s completion are owed matchable, if their writer still maps them."""
        state = self.expected
        for filled in state.matchable.due(step):
            model = state.seqs.get(filled.seq)
            if (
                model is not None
                and model.status is Status.RUNNING
                and filled.index < len(model.table)
                and model.table[filled.index] == filled.block
                and model.written >= state.layout(filled.seq).first_position(filled.index + 1)
            ):
                state.matchable.owe(filled)

    def _complete(self, steps: list[int]) -> None:
        """Complete each step (adopting its remaps), then check what its completion settled: the blocks whose
        in-flight window closed and every block the allocator held pending, so that a fault in deferred freeing is
        blamed on this step."""
        operation = self.checks.context.operation
        for step in steps:
            self.checks.context.operation = f"{operation}, completing step {step}"
            settled = set(self.pools.complete_step(step)) | self.checks.context.pending_now()
            for pair in self.host_stores.pop(step, ()):
                self._land_store(pair, f"as step {step} completed")
            self._call(functools.partial(self.allocator.step_completed, step))
            if self.caps.host_cache:
                self._check_host_in_use()
            if self.caps.remaps_on_step:
                self._adopt_remaps()
            self._owe_filled(step)
            for load in self.expected.async_loads.values():
                load.landable = load.landable or (load.launched_at is not None and load.launched_at <= step)
            self.checks.accounting.touched(settled)
            if self.caps.lookahead_blocks:
                self.checks.cache.lookahead_not_cached()
        self.checks.content.holds(self.pools.take_dirty())
        self.checks.context.operation = operation

    def _adopt_remaps(self) -> None:
        """An allocator that declares ``remaps_on_step`` may swap a running sequence's block for one holding the same
        K/V when a step completes (de-duplication): every new table is adopted, then every written position that
        moved is checked bit for bit, with refcounts and the free set."""
        touched: set[int] = set()
        positions: list[tuple[SeqId, int]] = []
        for seq in self.expected.ids(Status.RUNNING):
            model, size = self.expected.seqs[seq], self.expected.layout(seq).size
            table = self._table(seq)
            if table == model.table:
                continue
            moved = [index for index, (old, new) in enumerate(zip(model.table, table)) if old != new]
            touched |= self._set_table(seq, table, "remapped at step completion for", reuses_cached=True).touched
            self.stats["remapped blocks"] += len(moved)
            positions += [
                (seq, p) for index in moved for p in range(index * size, min((index + 1) * size, model.written))
            ]
        if touched:
            self.checks.content.holds(self.pools.take_dirty(), positions)
            self.checks.accounting.touched(touched)
