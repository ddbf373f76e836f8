"""The engine core: one example's pools, expected state and checks around one allocator, and the lifecycle every
operation shares: call the allocator (a refusal checked clean and justified), read a table back, record it (its
blocks' histories, the releases that start their in-flight windows), schedule and take writes, complete steps. At
each point of that lifecycle it fires an event (:mod:`kvfuzz.engine.events`) that the checks and the declared features
subscribe to; it knows no feature itself.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Callable, Optional, Sequence, TypeVar

import attrs

from kvfuzz.accounting.occupancy import Occupancy, measure
from kvfuzz.allocator.errors import AllocatorError, OutOfBlocks
from kvfuzz.allocator.protocol import AllocatorProtocol, HostIntrospectable
from kvfuzz.allocator.types import NULL_BLOCK, SeqId, Tokens, group_block_sizes
from kvfuzz.engine.checks import Checks, PoolCounts
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.events import Completion, EngineEvents
from kvfuzz.engine.expected import ExpectedState, Status, TableChange, common_prefix
from kvfuzz.engine.misuse import MisuseCall
from kvfuzz.engine.pools import KVPools, SlotWrite
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.reference.contiguous import ContiguousReference

T = TypeVar("T")

UNCHANGED = TableChange(frozenset(), (), ())
"""A table update that changed no block."""

# What a refused grow may change under a declared policy: given the pool counts before the call and the refusal,
# the counts the refusal must otherwise leave as they were.
OnRefusal = Callable[[Optional[PoolCounts], OutOfBlocks], Optional[PoolCounts]]


def merged(first: TableChange, second: TableChange) -> TableChange:
    """Two table updates of one operation (a sequence's tables in two KV-cache groups) as one."""
    return TableChange(
        first.touched | second.touched, first.released + second.released, first.acquired + second.acquired
    )


class GeometryMismatch(ValueError):
    """The allocator a factory built does not have the pool geometry kvfuzz asked for."""


def call_label(op: str, args: tuple[object, ...]) -> str:
    """An operation's call as reports show it: ``grow('s1', (3,))`` (a misuse call by its own description)."""
    shown = ", ".join(str(arg) if isinstance(arg, MisuseCall) else repr(arg) for arg in args)
    return f"{op}({shown})"


class EngineCore:
    """One example's engine core around one allocator: its K/V pools, its expected state, the checks, and the
    subscribers of its events."""

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
        self.stats: Counter[str] = stats if stats is not None else Counter()  # operations and outcomes, by name
        self.on_step = on_step  # called with the pool's occupancy after every step
        self.events = EngineEvents()  # who runs at each point of the lifecycle

    def close(self) -> None:
        """The example is over: release the K/V pools now rather than when the garbage collector runs."""
        self.pools.close()

    def diverged(self) -> Optional[InvariantViolation]:
        """The violation an audit of the allocator's whole observable state finds now (None: none), labelled with
        the operation last checked: where a replay first finds one is where the allocator departed from the model
        (:mod:`~kvfuzz.engine.checks.divergence`). Changes nothing."""
        try:
            self.checks.divergence.audit()
        except InvariantViolation as found:
            return found
        return None

    def at_boundaries(self, boundary: Callable[[], None], completed: Callable[[], None]) -> None:
        """Call ``boundary`` where one part of a call ends and the next begins: before each operation the engine
        begins (one call may make several: a decode grows every sequence, then steps) and before an operation's step
        completions, under the label of what came before; and ``completed`` after every completion, once its own
        checks have passed (a completion's deferred releases are a change of their own, labelled ``..., completing
        step N``). A replay audits the whole state there (:meth:`diverged`), besides after every call."""
        self.events.boundary.append(boundary)
        self.events.completed.append(lambda _: completed())

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

    # -- calling the allocator -----------------------------------------------------------------------------------

    def begin(self, op: str, *args: object) -> None:
        """An operation starts: every check until the next one is labelled with it (the label made into text only
        when a report reads it; a list argument is copied now, so that the label shows it as it was called)."""
        self.events.fire_boundary()  # under the label of what came before
        for arg in args:
            if type(arg) is list:
                args = tuple(list(arg) if type(arg) is list else arg for arg in args)
                break
        self.checks.context.operation = functools.partial(call_label, op, args)
        self.stats[op] += 1

    def blocks(self, num_tokens: int, table_id: SeqId) -> int:
        """How many blocks ``num_tokens`` tokens fill in ``table_id``'s table (a sequence's, or one group's)."""
        return self.expected.layout(table_id).blocks_for(num_tokens)

    def reach(self, num_tokens: int, table_id: SeqId) -> int:
        """The most blocks ``table_id``'s table may hold for ``num_tokens`` tokens: those they fill, and the
        look-ahead."""
        return self.blocks(num_tokens, table_id) + self.caps.lookahead_blocks

    def admit_needs(self, tokens: Tokens) -> int:
        """The most blocks an admission of ``tokens`` may need: a table's reach in every KV-cache group."""
        return sum(layout.blocks_for(len(tokens)) + self.caps.lookahead_blocks for layout in self.expected.layouts)

    def call(self, call: Callable[[], T]) -> T:
        """Run an operation that may not be refused."""
        try:
            return call()
        except AllocatorError as error:
            self.checks.refusals.valid_call_refused(error, out_of_blocks_allowed=False)

    def attempt(
        self,
        call: Callable[[], T],
        result_type: type,
        needed: int,
        absent: Optional[SeqId] = None,
        host: bool = False,
        on_refusal: Optional[OnRefusal] = None,
    ) -> Optional[T]:
        """Run an operation that may be refused for lack of space; check its result is well formed, and that a
        refusal is clean and justified (``on_refusal``: what a declared policy lets a refusal change first)."""
        before = self.checks.context.counts()
        cached_before = self.checks.context.cached_set() if self.caps.refusal_evicts else None
        try:
            result = call()
        except OutOfBlocks as error:
            self.stats["refused (out of blocks)"] += 1
            if on_refusal is not None:
                before = on_refusal(before, error)
            evicted = self.checks.refusals.unchanged(Invariant.ATOMIC_REFUSAL, before, error, absent, cached_before)
            for block in evicted:
                self.pools.note(block, f"evicted from the cache by the refused {self.checks.context.operation}")
                self.stats["evicted blocks (refusals)"] += 1
            self.checks.refusals.not_false(needed, error, host)
            return None
        except AllocatorError as error:
            self.checks.refusals.valid_call_refused(error, out_of_blocks_allowed=True)
        self.checks.results.result(result, result_type)
        return result

    # -- tables --------------------------------------------------------------------------------------------------

    def table(self, seq: SeqId) -> tuple[int, ...]:
        """``seq``'s table as the allocator reports it, checked well formed and shaped for its tokens."""
        table = self.checks.results.block_table(seq, self.allocator.block_table(seq))
        self.checks.results.table_shape(seq, table)
        return table

    def set_table(
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
        pools = self.pools
        for block in change.acquired:
            state.evicted.pop(block, None)
            pools.acquired_at[block] = pools.next_step
        model.table = table
        for index in range(common_prefix(old, table), len(table)):
            block = table[index]
            if index < len(old) and old[index] == block:
                continue
            if index < hit_blocks:
                pools.note(block, "matched by {}'s cache hit as its logical block {}", seq, index)
                pools.acquired_at.pop(block, None)  # a hit takes the K/V it holds: none of it is stale
                continue
            if block in pools.seen_cached and not reuses_cached:
                pools.note(block, "evicted from the cache, to be reused")
                pools.seen_cached.discard(block)
            if pools.freed_tags and state.layout(seq).size == pools.block_size:
                first = state.layout(seq).first_position(index)
                pools.taken_fresh(block, state.reference.tags(seq)[first : first + pools.block_size])
            pools.note(block, "{} {} as logical block {}", event, seq, index)
        for block in change.released:
            if released:
                pools.note(block, released)
            else:
                pools.note(block, "{} {}", event, seq)
            pools.release(block, seq)
        self.events.fire_table_set(seq, old, table, change, hit_tokens, held_tokens)
        return change

    def settle(self, change: TableChange, positions: Sequence[tuple[SeqId, int]] = ()) -> None:
        """After an operation: content of what it touched, then its subscribers (one group per block under
        ``kv_groups``; refcounts and the free set)."""
        self.checks.content.holds(self.pools.take_dirty(), positions)
        self.events.fire_table_changed(change)

    def evicted(self, blocks: Sequence[int], by: str) -> None:
        """``blocks`` left the cache: note it in their histories, remember it for the cache-soundness check, and
        check the pool's sets around them."""
        step = self.pools.next_step
        self.expected.matchable.forget(blocks)
        for block in blocks:
            self.pools.note(block, "evicted from the cache ({})", by)
            self.expected.evicted[block] = f"{by} while step {step} was being scheduled"
        self.settle(TableChange(frozenset(blocks), (), ()))

    def hit_not_evicted(self, seq: SeqId, table: tuple[int, ...], num_cached: int, loaded: set[int]) -> None:
        """Invariant 9: the hit of ``num_cached`` tokens covers no block of ``seq``'s new ``table`` (a sequence's, or
        one group's) that an eviction dropped, unless a host-tier load (``loaded``) refills it."""
        evicted = self.expected.evicted
        hit_blocks = table[: self.expected.layout(seq).blocks_for(num_cached)]
        stale = {
            index: evicted[block] for index, block in enumerate(hit_blocks) if block in evicted and block not in loaded
        }
        if stale:
            self.checks.cache.hit_on_evicted(seq, num_cached, table, stale)

    # -- writes and steps ----------------------------------------------------------------------------------------

    def withdraw_writes(self, seq: SeqId, why: str) -> None:
        """``seq``'s scheduled writes are withdrawn (``why``: its preemption, or an abort whose writes do not land):
        no other sequence's hit may rely on them (invariant 9), and each block they would have filled is noted as
        withdrawn from until a write lands in it, so that the audit of a replay (:meth:`diverged`) finds a cache
        that still offers it. Only a slot left holding nothing, or K/V of the block's life before a table last took
        it fresh (not by a hit), counts: a block's own earlier K/V (a rewrite the write would have made, in place)
        is still what its cache entry names."""
        self.checks.cache.withdrawn_writes_unread(seq, why)
        state, pools = self.expected, self.pools
        acquired_at = pools.acquired_at
        for _, slot in state.scheduled_writes(seq):
            record = pools.record(slot)
            block = slot // state.rows
            if record is None or record.step < acquired_at.get(block, 0):
                pools.withdrawn.setdefault(block, why)

    def take_scheduled_writes(self, seq: SeqId, via: str = "") -> tuple[list[int], list[SlotWrite]]:
        """The slots and writes of ``seq``'s scheduled tokens, each checked exclusive, and mark them written."""
        state = self.expected
        step = self.pools.next_step
        tags, namespace = state.reference.tags(seq), state.reference.namespace(seq)
        slots, writes = [], []
        checked = -1  # the block of the latest write checked exclusive: a block's verdict is the same for its slots
        for position, slot in state.scheduled_writes(seq):
            if slot // state.rows != checked:
                checked = slot // state.rows
                self.checks.exclusive.block(checked, seq, f"step {step} writes {seq} position {position}")
            slots.append(slot)
            writes.append(SlotWrite(tags[position], seq, namespace, position, step, via))
        model = state.seqs[seq]
        if model.written != len(tags):  # assigned only when it changes: each assignment notifies the state
            model.written = len(tags)
        return slots, writes

    def schedule_writes(self, seq: SeqId, first_position: int, op: str) -> None:
        """The next step writes ``seq``'s table (a sequence's, or one group's) from ``first_position`` on: each block
        it writes is no longer matchable, is ``seq``'s alone and is outside the in-flight window."""
        table = self.expected.seqs[seq].table
        targets = {
            index: table[index]
            for index in range(self.expected.layout(seq).index(first_position), len(table))
            if table[index] != NULL_BLOCK  # dropped entries are never written
        }
        self.expected.matchable.forget(targets.values())
        for index, block in targets.items():
            self.checks.exclusive.block(block, seq, f"{op} schedules writes of {seq}'s logical block {index}")
        self.checks.window.outside([block for index, block in targets.items() if not self._rewrite(seq, index)], seq)

    def _rewrite(self, seq: SeqId, index: int) -> bool:
        """Whether the write of ``seq``'s logical block ``index`` rewrites, in place, exactly the K/V its block holds
        (``recomputes_in_place``: the recomputed last token of a whole-prompt hit): in-flight work that reads it
        reads the same either way, so its in-flight window does not apply."""
        state = self.expected
        layout = state.layout(seq)
        if not state.caps.recomputes_in_place or layout.size != self.pools.block_size:
            return False
        tags = state.reference.tags(seq)
        first = layout.first_position(index)
        held = self.pools.block_tags(state.seqs[seq].table[index])
        return first + layout.size <= len(tags) and held == tuple(tags[first : first + layout.size])

    def complete(self, steps: list[int]) -> None:
        """Complete each step, then check what its completion settled (the blocks whose in-flight window closed and
        every block the allocator held pending, so that a fault in deferred freeing is blamed on this step) through
        the subscribers of step completion."""
        if steps:
            self.events.fire_boundary()
        operation = self.checks.context.operation
        for step in steps:
            self.checks.context.operation = f"{operation}, completing step {step}"
            settled = set(self.pools.complete_step(step)) | self.checks.context.pending_now()
            self.events.fire_completing(step)
            self.call(functools.partial(self.allocator.step_completed, step))
            self.events.fire_completed(Completion(step, settled))
        self.checks.content.holds(self.pools.take_dirty())
        self.checks.context.operation = operation
