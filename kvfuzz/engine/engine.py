"""The serving engine kvfuzz plays around an allocator: each operation calls the allocator, performs what it orders
(writes, copies, swaps), updates the expected state and the contiguous reference, and has the checks look at what
changed. The lifecycle every operation shares is the core's (:mod:`kvfuzz.engine.core`); what a capability adds is a
feature's (:mod:`kvfuzz.engine.features`), built and subscribed to the core's events here when the allocator declares
it.

The engine knows only the contract, never a particular allocator. The operation table (:mod:`kvfuzz.program`)
drives it for the Hypothesis machine, random programs and replay; the workload scheduler and unit tests drive it
directly through the same methods.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Callable, Optional, Sequence, cast

from kvfuzz.accounting.occupancy import Occupancy
from kvfuzz.allocator.errors import Misuse
from kvfuzz.allocator.protocol import AllocatorProtocol, Evicts
from kvfuzz.allocator.types import AdmitResult, BlockCopy, GrowResult, Namespace, SeqId, Tokens
from kvfuzz.engine.checks import CacheSnapshot
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.core import EngineCore, GeometryMismatch, OnRefusal, merged
from kvfuzz.engine.events import Launch
from kvfuzz.engine.expected import SeqModel, Status, mapped
from kvfuzz.engine.features import eviction, forks, preemption, rollback, swap
from kvfuzz.engine.features.copies import StepRemaps, TailDeduplication
from kvfuzz.engine.features.groups import GroupTables, WindowDrops, forget
from kvfuzz.engine.features.host_tier import AsyncLoading, HostTier
from kvfuzz.engine.features.lookahead import LookAhead
from kvfuzz.engine.features.prefix_cache import CachingDebt, check_missed_hit
from kvfuzz.engine.features.scheduling import abort_policy
from kvfuzz.engine.misuse import MisuseCall
from kvfuzz.engine.violations import Invariant
from kvfuzz.reference.content import prefix_tags

__all__ = ["Engine", "GeometryMismatch"]


class Engine(EngineCore):
    """One example's engine around one allocator: the core, and the features the allocator declares (None where it
    does not)."""

    def __init__(
        self,
        allocator: AllocatorProtocol,
        config: MachineConfig,
        stats: Optional[Counter[str]] = None,
        on_step: Optional[Callable[[Occupancy], None]] = None,
    ) -> None:
        super().__init__(allocator, config, stats, on_step)
        caps, checks = self.caps, self.checks
        self.groups = GroupTables(self) if caps.kv_groups else None
        self.window_drops = WindowDrops(self, self.groups) if caps.refusal_drops_window else None
        self.async_loading = AsyncLoading(self) if caps.async_loads else None
        self.expected.async_loading = self.async_loading  # which loads the operation table may report landed
        self.host_tier = HostTier(self, self.async_loading) if caps.host_cache else None
        self.abort_policy = abort_policy(self, self.host_tier)
        self.lookahead = LookAhead(self) if caps.lookahead_blocks else None
        self.caching_debt = CachingDebt(self) if checks.context.owes_caching() else None
        self.tail_dedup = TailDeduplication(self) if caps.dedupes_copied_tail else None
        self.remaps = StepRemaps(self) if caps.remaps_on_step else None
        self._subscribe()

    def _subscribe(self) -> None:
        """Every subscriber of the core's events, event by event in lifecycle order, each event's in the order it
        runs them (the order in which their violations would be found)."""
        events, checks, pools = self.events, self.checks, self.pools
        host_tier, async_loading = self.host_tier, self.async_loading
        debt, lookahead = self.caching_debt, self.lookahead
        if lookahead is not None:
            events.table_set.append(lookahead.table_set)
        if debt is not None:
            events.table_set.append(debt.table_set)
        if self.groups is not None:
            events.table_changed.append(self.groups.changed)
        events.table_changed.append(lambda change: checks.accounting.touched(change.touched))
        if host_tier is not None:
            events.releasing.append(host_tier.hold_loading)
        if async_loading is not None:
            events.releasing.append(async_loading.hold_until_landed)
        if debt is not None:
            events.scheduling.append(debt.scheduling)
        if host_tier is not None:
            events.launching.append(host_tier.launching)
        events.launched.append(lambda step: checks.content.holds(pools.take_dirty()))
        events.launched.append(lambda step: checks.attention.check())
        if host_tier is not None:
            events.completing.append(host_tier.completing)
            events.completed.append(host_tier.completed)
        if self.remaps is not None:
            events.completed.append(self.remaps.completed)
        if debt is not None:
            events.completed.append(debt.completed)
        if async_loading is not None:
            events.completed.append(async_loading.landable)
        events.completed.append(lambda completion: checks.accounting.touched(completion.settled))
        if lookahead is not None:
            events.completed.append(lookahead.completed)
        events.quiesced.append(checks.quiescence.check)

    # -- operations ----------------------------------------------------------------------------------------------

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> bool:
        """A new request; returns whether it was admitted."""
        self.begin("admit", seq, namespace, tokens)
        before = self.checks.eviction_order.snapshot()
        free_before = self.checks.cache.free_before(before)
        owed = self.caching_debt.owed(prefix_tags(namespace, tokens)) if self.caching_debt is not None else []
        result = self.attempt(
            lambda: self.allocator.admit(seq, namespace, tokens), AdmitResult, self.admit_needs(tokens), absent=seq
        )
        if result is None:
            return False
        self.expected.reference.add(seq, namespace, tokens)
        if self.groups is not None:
            self.groups.admitted(seq, namespace, tokens)
        self._admission(seq, result, before, owed, free_before)
        return True

    def readmit(self, seq: SeqId) -> bool:
        """A preempted request comes back with every token it had; returns whether it was admitted."""
        reference = self.expected.reference
        namespace, tokens = reference.namespace(seq), tuple(reference.tokens(seq))
        self.begin("readmit", seq)
        before = self.checks.eviction_order.snapshot()
        free_before = self.checks.cache.free_before(before)
        owed = self.caching_debt.owed(reference.tags(seq)) if self.caching_debt is not None else []
        result = self.attempt(
            lambda: self.allocator.admit(seq, namespace, tokens), AdmitResult, self.admit_needs(tokens), absent=seq
        )
        if result is None:
            return False
        self._admission(seq, result, before, owed, free_before)
        return True

    def land_loads(self, seq: SeqId) -> None:
        """Under ``async_loads``: the worker has finished ``seq``'s asynchronous loads (their step completed some
        time ago); see :meth:`~kvfuzz.engine.features.host_tier.AsyncLoading.land`."""
        cast(AsyncLoading, self.async_loading).land(seq)

    def resume(self, seq: SeqId) -> bool:
        """Under ``async_loads``: schedule a sequence whose loads have landed; the allocator allocates the rest of its
        prompt (or refuses, changing nothing) and returns the whole table with the hit its admission reported.
        Returns whether it found room."""
        resumed = cast(AsyncLoading, self.async_loading).resume(seq)
        if resumed is None:
            return False
        result, before = resumed
        self._admitted(seq, result.block_table, result.num_cached_tokens, before)
        self.stats["resumed after asynchronous loads"] += 1
        return True

    def grow(self, seq: SeqId, tokens: Tokens) -> bool:
        """Append tokens (decode, a chunk, speculative drafts); returns whether the allocator found room."""
        model = self.expected.seqs[seq]
        old_len = self.expected.length(seq)
        self.begin("grow", seq, tokens)
        needed = sum(
            max(0, self.reach(old_len + len(tokens), table_id) - len(self.expected.seqs[table_id].table))
            + (old_len % self.expected.layout(table_id).size != 0)
            for table_id in (seq, *self.expected.group_tables(seq))
        )
        before = self.checks.eviction_order.snapshot()
        on_refusal: Optional[OnRefusal] = None
        if self.window_drops is not None:
            on_refusal = functools.partial(self.window_drops.refused, seq)
        result = self.attempt(lambda: self.allocator.grow(seq, tokens), GrowResult, needed, on_refusal=on_refusal)
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
        table = self.table(seq)
        self.checks.content.grow_slots(seq, result.slots, table, old_len, len(tokens))
        released = f"released by {seq}'s copy-on-write (grow)"
        change = self.set_table(seq, table, "grown into", released)
        if self.groups is not None:
            change = merged(change, self.groups.set_tables(seq, table, "grown into", released))
        deduplicated: Sequence[BlockCopy] = ()
        if self.tail_dedup is not None:
            deduplicated = self.tail_dedup.deduplicated(seq, result.copies, old_table, old_len)
        self.settle(change)
        if deduplicated:
            self.checks.accounting.touched(copy.dst for copy in deduplicated)
        self.checks.eviction_order.evictions(before, (), reuse=True, given_back=(copy.dst for copy in deduplicated))
        table_ids = (seq, *self.expected.group_tables(seq))
        for copy in result.copies:
            if copy in deduplicated:
                continue  # wasted work into a block nobody holds: not a write into anyone's block
            holders = {holder for holder, _ in self.expected.refs.holders.get(copy.dst, ())}
            writer = next((table_id for table_id in table_ids if table_id in holders), seq)  # the group it went to
            self.checks.exclusive.block(copy.dst, writer, f"copy-on-write copy from block {copy.src}")
        self.expected.matchable.forget(copy.dst for copy in result.copies)
        for table_id in table_ids:
            self.schedule_writes(table_id, old_len, "grow")
        self.checks.window.outside({copy.dst for copy in result.copies}, seq)
        return True

    def fork(self, parent: SeqId, child: SeqId) -> bool:
        """Under ``fork``: see :func:`kvfuzz.engine.features.forks.fork`."""
        return forks.fork(self, self.groups, parent, child)

    def free(self, seq: SeqId, *, run_ends: bool = False) -> None:
        """The request finished or was cancelled (possibly before its first step).

        Its scheduled writes land or are withdrawn as :mod:`~kvfuzz.engine.features.scheduling` says (``run_ends``:
        every sequence goes, and nothing reads again)."""
        state = self.expected
        self.begin("free", seq)
        if state.seqs[seq].status is Status.RUNNING:
            self.abort_policy.abort(seq, run_ends)
        self.events.fire_releasing(seq)
        self.call(lambda: self.allocator.free(seq))
        change = self.set_table(seq, (), "released (free) by")
        for table_id in state.group_tables(seq):
            change = merged(change, self.set_table(table_id, (), "released (free) by"))
            forget(self, table_id)
        host_table = mapped(state.seqs[seq].host_table)
        state.matchable.cancel(seq)
        del state.seqs[seq]
        state.retire(seq)
        state.reference.remove(seq)
        state.finished.append(seq)
        self.settle(change)
        if host_table:
            self.checks.accounting.host_accounting(host_table, released_by=f"free({seq!r}) of a swapped-out sequence")

    def preempt(self, seq: SeqId) -> None:
        """Under ``preemption``: see :func:`kvfuzz.engine.features.preemption.preempt`."""
        preemption.preempt(self, seq)

    def swap_out(self, seq: SeqId) -> bool:
        """Under ``swap``: see :func:`kvfuzz.engine.features.swap.swap_out`."""
        return swap.swap_out(self, seq)

    def swap_in(self, seq: SeqId) -> bool:
        """Under ``swap``: see :func:`kvfuzz.engine.features.swap.swap_in`."""
        return swap.swap_in(self, seq)

    def rollback(self, seq: SeqId, num_tokens: int) -> None:
        """Under ``rollback``: see :func:`kvfuzz.engine.features.rollback.rollback`."""
        rollback.rollback(self, seq, num_tokens)

    def evict(self, num_blocks: int) -> None:
        """Under ``eviction``: see :func:`kvfuzz.engine.features.eviction.evict`."""
        eviction.evict(self, num_blocks)

    def evict_blocks(self, blocks: tuple[int, ...]) -> None:
        """Under ``targeted_eviction``: see :func:`kvfuzz.engine.features.eviction.evict_blocks`."""
        eviction.evict_blocks(self, blocks)

    def reset_cache(self) -> None:
        """Under ``eviction``: see :func:`kvfuzz.engine.features.eviction.reset_cache`."""
        eviction.reset_cache(self)

    def step(self) -> int:
        """One forward pass: write the K/V of every new token, then every running sequence attends."""
        self.begin("step")
        step = self.pools.next_step
        self.events.fire_scheduling(step)
        launch = Launch(step, [], [])
        for seq in self.expected.ids(Status.RUNNING, groups=True):
            seq_slots, seq_writes = self.take_scheduled_writes(seq)
            launch.slots += seq_slots
            launch.writes += seq_writes
        self.events.fire_launching(launch)
        slots, writes = launch.slots, launch.writes
        self.pools.launch_step()
        if slots:
            self.pools.write(slots, writes)
        for model in self.expected.seqs.values():
            if model.awaits_step:  # assigned only when it changes: each assignment notifies the state
                model.awaits_step = False
        self.stats["tokens written"] += len(slots)
        self.events.fire_launched(step)
        self.complete(self.pools.steps_to_complete())
        if self.on_step is not None:
            self.on_step(self.occupancy())
        return step

    def misuse(self, call: MisuseCall) -> None:
        """A call that breaks the contract: it must raise a Misuse error and change nothing."""
        self.begin("misuse", call)
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
                forget(self, table_id)
            del state.seqs[seq]
            state.retire(seq)
            state.reference.remove(seq)
        else:
            self.free(seq, run_ends=run_ends)

    def quiesce(self) -> None:
        """Invariant 10: once every sequence is gone and the in-flight work done, every block is free."""
        for seq in [seq for seq, model in self.expected.seqs.items() if not model.owner]:
            self.dismiss(seq, run_ends=True)
        self.begin("quiesce")
        self.complete(self.pools.steps_to_complete(drain=True))
        host_tier, async_loading = self.host_tier, self.async_loading
        while (
            self.pools.late_work_by_block
            or self.pools.held_until
            or async_loading is not None
            and async_loading.loads
            or host_tier
            and host_tier.loads
        ):
            if host_tier is not None:  # a launch lands the loads still ordered, as the worker would
                host_tier.transfers(self.pools.next_step)
            self.pools.launch_step()
            self.complete(self.pools.steps_to_complete(drain=True))
            operation = self.checks.context.operation
            for seq in self.expected.landable_ids():  # the worker reports every asynchronous load
                self.land_loads(seq)
            self.checks.context.operation = operation
        if self.caps.eviction:
            self.call(cast(Evicts, self.allocator).reset_cache)
        self.events.fire_quiesced()

    # -- admissions ----------------------------------------------------------------------------------------------

    def _admitted(
        self,
        seq: SeqId,
        reported: Sequence[int],
        num_cached: int,
        before: Optional[CacheSnapshot] = None,
        owed: Sequence[tuple[int, str]] = (),
        loads: Sequence[tuple[int, int]] = (),
        free_before: frozenset[int] = frozenset(),
    ) -> None:
        model = self.expected.seqs.setdefault(seq, SeqModel(seq, Status.RUNNING))
        model.joined_step = self.pools.next_step
        model.status, model.written, model.drafts = Status.RUNNING, num_cached, 0
        model.dropped_at_length = -1
        table = self.checks.results.block_table(seq, self.allocator.block_table(seq))
        loaded = {block for _, block in loads}  # a host-tier load refills these: their old content is not read
        # the cause of what the checks after it see
        if loads:
            self.checks.cache.loads_into_the_hit(seq, table, loads, num_cached)
        self.checks.cache.hit_on_released(seq, table, num_cached, free_before, loaded)
        self.checks.results.table_shape(seq, table)
        self.checks.content.admit_table(seq, tuple(reported), table)
        table_ids = (seq, *self.expected.group_tables(seq))
        for group, table_id in enumerate(table_ids[1:], start=1):
            member = self.expected.seqs.setdefault(table_id, SeqModel(table_id, Status.RUNNING, group=group, owner=seq))
            member.status, member.written, member.joined_step = Status.RUNNING, num_cached, model.joined_step
            member.dropped_at_length = -1
        group_tables = self.groups.tables(seq, table) if self.groups is not None else []
        for table_id, read in ((seq, table), *group_tables):
            self.hit_not_evicted(table_id, read, num_cached, loaded)
        change = self.set_table(seq, table, "admitted as", hit_tokens=num_cached)
        for table_id, read in group_tables:
            change = merged(change, self.set_table(table_id, read, "admitted as", hit_tokens=num_cached))
        self.events.fire_table_changed(change)
        if loads:  # checked declared (host_cache) first
            self.checks.cache.host_loads(seq, loads)
            self.checks.window.outside([block for _, block in loads], seq)
            cast(HostTier, self.host_tier).ordered(seq, loads)
            self.stats["host-tier loads"] += len(loads)
        loading = self.host_tier.loading() if self.host_tier is not None else set()
        awaits = bool(loads)
        if self.groups is not None:
            self.groups.hit(seq, num_cached)
        for table_id in table_ids:
            if self.groups is not None:
                self.groups.hit_window(table_id, num_cached)
            awaits = self.checks.cache.cache_hit(table_id, num_cached, loading) or awaits
        model.awaits_step = awaits
        check_missed_hit(self.checks.context, seq, num_cached, owed)
        hit_blocks = [
            block
            for table_id, read in ((seq, table), *group_tables)
            for block in read[: self.expected.layout(table_id).blocks_for(num_cached)]
        ]
        self.checks.eviction_order.evictions(before, hit_blocks, reuse=True)
        # A whole-prompt hit passes only under recomputes_last_token: the engine writes the last token again.
        for table_id in table_ids:
            self.expected.seqs[table_id].written = min(num_cached, self.expected.length(seq) - 1)
            self.schedule_writes(table_id, model.written, "admit")
        if num_cached:
            self.stats["cache hits"] += 1
            self.stats["cache-hit tokens"] += num_cached
        self.checks.content.holds(self.pools.take_dirty())

    def _admission(
        self,
        seq: SeqId,
        result: AdmitResult,
        before: Optional[CacheSnapshot],
        owed: Sequence[tuple[int, str]],
        free_before: frozenset[int] = frozenset(),
    ) -> None:
        """An admission (or readmission) the allocator accepted: one that waits for its loads, or one that runs."""
        if result.waits_for_loads:
            self.checks.results.waits_for_loads(seq, result)  # declared (async_loads) first
            cast(AsyncLoading, self.async_loading).waiting(seq, result, before, owed)
        else:
            self._admitted(seq, result.block_table, result.num_cached_tokens, before, owed, result.loads, free_before)
