"""The host tier and asynchronous loads (``host_cache``, ``async_loads``): the loads and stores between the device
and host pools that the allocator orders and the engine performs as its worker would, each checked as it lands, and
admissions that wait for their loads to land before they are scheduled (``resume``). The ``land_loads`` and
``resume`` rows (:data:`ROWS`, its rows of the operation table) call the engine's methods of those names. The checks
only the host tier triggers are the feature's own: the transfers it takes (invariant 12), the host blocks they use
(4) and a resumed sequence's hit (9 and 12).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, cast

import attrs

from kvfuzz.allocator.protocol import AsyncLoads, HostCache
from kvfuzz.allocator.types import AdmitResult, HostTransfers, SeqId
from kvfuzz.engine.arguments import Pick
from kvfuzz.engine.checks import CacheSnapshot, CheckContext
from kvfuzz.engine.checks.results import is_int, shown
from kvfuzz.engine.core import EngineCore
from kvfuzz.engine.events import Completion, Launch
from kvfuzz.engine.expected import SeqModel, Status, mapped
from kvfuzz.engine.features.prefix_cache import check_missed_hit
from kvfuzz.engine.operation import Operation
from kvfuzz.engine.pools import UNTIL_LOADS_LAND, SlotWrite
from kvfuzz.engine.violations import Cause, Invariant


class HostTier:
    """Under ``host_cache``: the transfers in flight. Invariant kept: ``loads`` are the loads ordered by admissions
    since the last launch, which the next launch lands; ``stores`` the stores ordered and not landed, by the step
    whose completion lands them (unless the allocator flushes them first)."""

    def __init__(self, core: EngineCore, async_loading: Optional[AsyncLoading]) -> None:
        self.core = core  # the engine this feature is part of
        self.async_loading = async_loading  # the admissions' asynchronous loads, under async_loads
        # Loads ordered by admissions since the last launch, (sequence, host block, device block).
        self.loads: list[tuple[SeqId, int, int]] = []
        # The writes of sequences freed since the last launch: that launch makes them, after the flushed stores and
        # the loads (written at once without a host tier, since nothing can tell the two orders apart).
        self.aborted_writes: list[tuple[int, SlotWrite]] = []
        # Stores in flight, step -> (device block, host block) pairs, landed when that step completes.
        self.stores: dict[int, list[tuple[int, int]]] = {}

    def ordered(self, seq: SeqId, loads: Sequence[tuple[int, int]]) -> None:
        """An admission of ``seq`` that runs ordered these loads (host block, device block): the next launch lands
        them."""
        self.loads += [(seq, host_block, block) for host_block, block in loads]

    def loading(self) -> set[int]:
        """The device blocks the next launch fills from the host pool."""
        return {block for _, _, block in self.loads}

    def defer_aborted(self, seq: SeqId) -> None:
        """``seq`` is freed with writes scheduled, which the next launch makes (after its transfers); the step that
        makes them reads every block of its table until it completes."""
        core, state = self.core, self.core.expected
        slots, writes = core.take_scheduled_writes(seq, "scheduled before the abort")
        self.aborted_writes += zip(slots, writes)
        state.aborted_tags.update((slot, write.tag) for slot, write in zip(slots, writes))
        if slots:
            until = core.pools.last_completed + core.caps.inflight_window + 1
            for block in mapped(state.seqs[seq].table):
                core.pools.read_until[block] = max(core.pools.read_until.get(block, -1), until)

    def launching(self, launch: Launch) -> None:
        """A step is being launched: its transfers land, then the aborted writes come first among its writes."""
        self.transfers(launch.step)
        launch.slots[:0] = [slot for slot, _ in self.aborted_writes]
        launch.writes[:0] = [write for _, write in self.aborted_writes]
        self.aborted_writes.clear()
        self.core.expected.aborted_tags.clear()

    def transfers(self, step: int) -> None:
        """As ``step`` is launched: the allocator's transfer order, then the flushed stores and the loads land (in
        that order, as vLLM's worker flushes before it loads), each load checked for content."""
        core = self.core
        transfers = core.call(functools.partial(cast(HostCache, core.allocator).take_transfers, step))
        core.checks.results.result(transfers, HostTransfers, f"take_transfers({step})")
        stores = list(transfers.stores)
        in_flight = [pair for pairs in self.stores.values() for pair in pairs] + stores
        check_host_transfers(core.checks.context, step, transfers, in_flight)
        for pair in transfers.flushed:
            for pairs in (*self.stores.values(), stores):
                if pair in pairs:
                    pairs.remove(pair)
                    break
            self._land_store(pair, f"flushed before step {step}")
        positions: list[tuple[SeqId, int]] = []
        for seq, host_block, block in self.loads:
            core.pools.note(block, f"loaded from host block {host_block} for {seq}")
            core.pools.swap_from_host(host_block, block, f"loaded from host block {host_block} for {seq}")
            model = core.expected.seqs.get(seq)
            if model is not None and model.status is Status.RUNNING and block in model.table:
                index, size = model.table.index(block), core.expected.layout(seq).size
                positions += [(seq, p) for p in range(index * size, min((index + 1) * size, model.written))]
        self.loads.clear()
        for load in self.async_loading.loads.values() if self.async_loading is not None else ():
            if load.launched_at is None:
                load.launched_at = step  # the worker starts them now; they land when the engine reports them
        core.checks.content.holds(core.pools.take_dirty(), positions)
        if stores:
            self.stores.setdefault(step, []).extend(stores)
        core.stats["host-tier stores"] += len(transfers.stores)
        self.check_in_use()

    def completed(self, completion: Completion) -> None:
        """A step completed: the transfers still in flight keep their host blocks."""
        self.check_in_use()

    def check_in_use(self) -> None:
        """Where the allocator lists its host free set: no host block a transfer still uses (a store in flight
        writing it, an asynchronous load not yet reported reading it) is in that set. Nothing is gathered when
        there is no set to check it against (every launch and completed step passes here)."""
        core = self.core
        if core.checks.context.host_introspection is None:
            return
        in_use = {
            host_block: f"the store of block {block} into it, ordered at the launch of step {step}, is in flight"
            for step, pairs in self.stores.items()
            for block, host_block in pairs
        }
        for seq, load in self.async_loading.loads.items() if self.async_loading is not None else ():
            for host_block, block in load.pairs:
                in_use[host_block] = f"the asynchronous load of {seq} from it into block {block} is not reported landed"
        check_host_transfers_unfree(core.checks.context, in_use)

    def completing(self, step: int) -> None:
        """The stores ordered at ``step``'s launch land as it completes."""
        for pair in self.stores.pop(step, ()):
            self._land_store(pair, f"as step {step} completed")

    def _land_store(self, pair: tuple[int, int], when: str) -> None:
        block, host_block = pair
        self.core.pools.note(block, f"stored into host block {host_block} ({when})")
        self.core.pools.swap_to_host(block, host_block, f"stored from block {block} ({when})")

    def hold_loading(self, seq: SeqId) -> None:
        """Before a running ``seq`` releases its table: a block that a load ordered since the last launch still
        fills stays in flight until the next step to complete has completed, which comes after the next launch lands
        the load (under W = 0 it is the step of that launch): the allocator may hold it pending until then, as one
        that acknowledges the load when its step completes does, and must not hand it out before. The blocks of the
        prefix such a load extends (its table before the loaded block) may be held pending until then too, as a tree
        cache keeps a loaded node's ancestors resident, but may be handed out: no load writes them."""
        pools, model = self.core.pools, self.core.expected.seqs[seq]
        if model.status is not Status.RUNNING:
            return
        loading = self.loading()
        until = pools.last_completed + 1
        table = model.table
        last_loaded = max((index for index, block in enumerate(table) if block in loading), default=-1)
        for block in mapped(table[: last_loaded + 1]):
            if block in loading:
                pools.read_until[block] = max(pools.read_until.get(block, -1), until)
            else:  # the prefix the load extends, which a tree cache keeps resident until it acknowledges the load
                pools.held_until[block] = max(pools.held_until.get(block, -1), until)


@attrs.define
class AsyncLoad:
    """One admission's asynchronous host-tier loads (``async_loads``), from the admission until the engine reports
    them landed. Invariant kept: ``landable`` is set exactly when the step that started them has completed."""

    pairs: tuple[tuple[int, int], ...]  # (host block, device block), as the admission ordered them
    table: tuple[int, ...]  # the sequence's table when it was admitted: the blocks its hit covers
    launched_at: Optional[int] = None  # the step whose launch started them (None: not launched yet)
    landable: bool = False  # that step has completed: the worker may report them done


class AsyncLoading:
    """Under ``async_loads``: admissions waiting for their loads (``loads``), landed when the engine reports them and
    then resumed. Invariant kept: a load is ``landable`` once the step whose launch started it has completed; every
    change of ``loads`` or of a load's ``landable`` is told to the expected state (``changed``: what enablement
    reads)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core  # the engine this feature is part of
        # Sequence (live or freed) -> its admission's loads not yet reported landed.
        self.loads: dict[SeqId, AsyncLoad] = {}

    def landable_ids(self) -> list[SeqId]:
        """Sequences (live, or freed while loading) whose asynchronous loads may be reported landed now."""
        return [seq for seq, load in self.loads.items() if load.landable]

    def waiting(
        self, seq: SeqId, result: AdmitResult, before: Optional[CacheSnapshot], owed: Sequence[tuple[int, str]]
    ) -> None:
        """An admission waiting for its loads. Its table covers the hit alone; the hit's blocks that no load fills
        must hold the prefix now, and the loaded ones are checked when the loads land."""
        core = self.core
        checks = core.checks
        num_cached = result.num_cached_tokens
        model = core.expected.seqs.setdefault(seq, SeqModel(seq, Status.LOADING))
        model.status, model.written, model.drafts, model.covered_tokens = Status.LOADING, 0, 0, num_cached
        model.joined_step, model.dropped_at_length = core.pools.next_step, -1
        table = core.table(seq)
        checks.cache.loads_into_the_hit(seq, table, result.loads, num_cached)
        checks.content.admit_table(seq, tuple(result.block_table), table)
        loaded = {block for _, block in result.loads}
        core.hit_not_evicted(seq, table, num_cached, loaded)
        change = core.set_table(seq, table, "admitted (waiting for its loads) as", hit_tokens=num_cached)
        checks.accounting.touched(change.touched)
        checks.cache.host_loads(seq, result.loads)
        checks.window.outside(loaded, seq)
        checks.cache.cache_hit(seq, num_cached, loaded)
        check_missed_hit(checks.context, seq, num_cached, owed)
        checks.eviction_order.evictions(before, table, reuse=True)
        self.loads[seq] = AsyncLoad(result.loads, table)
        core.expected.changed()
        core.stats["host-tier loads"] += len(result.loads)
        core.stats["admissions waiting for their loads"] += 1
        core.stats["cache hits"] += 1
        core.stats["cache-hit tokens"] += num_cached
        checks.content.holds(core.pools.take_dirty())

    def land(self, seq: SeqId) -> None:
        """The worker has finished ``seq``'s loads: the engine performs them, checks a live sequence's whole hit
        holds its prefix, and reports them to the allocator; a sequence freed while loading lets its blocks go, each
        leaving the in-flight window once its own window (from its release) has closed."""
        core = self.core
        core.begin("land_loads", seq)
        load = self.loads.pop(seq)
        core.expected.changed()
        for host_block, block in load.pairs:
            via = f"loaded asynchronously from host block {host_block} for {seq}"
            core.pools.note(block, via)
            core.pools.swap_from_host(host_block, block, via, step=core.pools.last_completed)
        model = core.expected.seqs.get(seq)
        covered = model.covered_tokens or 0 if model is not None else 0
        positions = [(seq, position) for position in range(covered)]
        if model is not None:
            model.written = covered
        core.checks.content.holds(core.pools.take_dirty(), positions)
        core.call(lambda: cast(AsyncLoads, core.allocator).loads_landed(seq))
        core.stats["asynchronous loads landed"] += 1
        if model is not None:
            model.status = Status.LOADED
            core.checks.accounting.touched(mapped(model.table))
        else:  # its blocks go, but for those another sequence freed while loading still holds until its own report
            # (a live one's loads hold nothing: its blocks are referenced, and hold_until_landed marks them if it too
            # is freed before its report; counting it here kept the hold of a block it shares past every report)
            held = {
                block
                for other_seq, other in self.loads.items()
                if other_seq not in core.expected.seqs
                for block in mapped(other.table)
            }
            core.checks.accounting.touched(
                core.pools.lift([block for block in mapped(load.table) if block not in held])
            )

    def resume(self, seq: SeqId) -> Optional[tuple[AdmitResult, Optional[CacheSnapshot]]]:
        """Schedule a sequence whose loads have landed: the allocator allocates the rest of its prompt (or refuses,
        changing nothing) and returns the whole table with the hit its admission reported, checked here. Returns
        the result and the cache before it, for the engine to record the admission; None when refused."""
        core = self.core
        core.begin("resume", seq)
        model = core.expected.seqs[seq]
        covered = model.covered_tokens or 0
        before = core.checks.eviction_order.snapshot()
        result = core.attempt(
            lambda: cast(AsyncLoads, core.allocator).resume(seq),
            AdmitResult,
            core.blocks(core.expected.length(seq), seq) - len(model.table),
        )
        if result is None:
            return None
        check_resumed_hit(core.checks.context, seq, result, covered)
        model.covered_tokens = None
        return result, before

    def landable(self, completion: Completion) -> None:
        """The loads whose launch step has completed may be reported landed."""
        for load in self.loads.values():
            if not load.landable and load.launched_at is not None and load.launched_at <= completion.step:
                load.landable = True
                self.core.expected.changed()

    def hold_until_landed(self, seq: SeqId) -> None:
        """Before a loading sequence releases its table: the blocks its loads fill stay in flight until the engine
        reports those loads landed (the worker still writes them); the rest of its table may be held pending until
        then (vLLM frees a loading request's blocks only once its loads are done), but may be handed out."""
        load = self.loads.get(seq)
        if load is None:
            return
        pools = self.core.pools
        loading = {block for _, block in load.pairs}
        for block in mapped(load.table):
            if block in loading:
                pools.read_until[block] = UNTIL_LOADS_LAND
            else:
                pools.held_until[block] = UNTIL_LOADS_LAND


def check_resumed_hit(context: CheckContext, seq: str, result: AdmitResult, covered: int) -> None:
    """``resume`` of a sequence whose loads landed reports the hit its admission reported, loads nothing, and
    keeps the hit in the blocks that hold it (invariant 9: a hit moved elsewhere holds nothing)."""
    held = context.state.seqs[seq].table
    moved = [
        index
        for index, block in enumerate(held)
        if index >= len(result.block_table) or result.block_table[index] != block
    ]
    if moved:
        context.fail(
            Invariant.CACHE_SOUNDNESS,
            f"resume of {seq} maps its cached logical block {moved[0]} to block "
            f"{result.block_table[moved[0]] if moved[0] < len(result.block_table) else 'none'}",
            [
                f"expected: the blocks its admission's hit holds (loaded or matched), {list(held)}, then the rest",
                f"found:    {list(result.block_table)}",
                *context.pools.block_story(held[moved[0]]),
            ],
            Cause("a resume that moved its cache hit to other blocks"),
        )
    if result.num_cached_tokens != covered or result.loads or result.waits_for_loads:
        context.fail(
            Invariant.RESULTS,
            f"resume of {seq} reports {result.num_cached_tokens} cached tokens, loads {list(result.loads)}"
            + (" and waits for them" if result.waits_for_loads else ""),
            [
                f"expected: the {covered} cached tokens its admission reported (loaded since), nothing more to "
                "load, no waiting"
            ],
            Cause("a resume that reports another hit, or loads or waits again"),
        )


def check_host_transfers_unfree(context: CheckContext, in_use: dict[int, str]) -> None:
    """Invariant 4 on a host tier: a host block a transfer still uses (``in_use``: host block -> the transfer) is
    not in the host free set, from which another store could take it."""
    host = context.host_introspection
    if host is None or not in_use:
        return
    free = set(host.host_free_blocks())
    for block, transfer in sorted(in_use.items()):
        if block in free:
            context.fail(
                Invariant.FREE_SET,
                f"host block {block} is in the host free set while {transfer}",
                ["expected: out of the host free set until that transfer is done"],
                Cause("a host block in the host free set while a transfer still uses it"),
            )


def check_host_transfers(
    context: CheckContext, step: int, transfers: HostTransfers, in_flight: Sequence[tuple[int, int]]
) -> None:
    """Invariant 12 for ``take_transfers(step)``: stores between existing blocks, and only in-flight stores
    flushed."""
    h = context.state
    for block, host_block in transfers.stores:
        if not (
            is_int(block) and 0 <= block < h.num_blocks and is_int(host_block) and 0 <= host_block < h.num_host_blocks
        ):
            context.fail(
                Invariant.RESULTS,
                f"take_transfers({step}) stores block {shown(block)} into host block {shown(host_block)}",
                [f"expected: a device block 0 .. {h.num_blocks - 1} and a host block 0 .. {h.num_host_blocks - 1}"],
                Cause("take_transfers ordered a store outside the pools"),
            )
    for pair in transfers.flushed:
        if tuple(pair) not in in_flight:
            context.fail(
                Invariant.RESULTS,
                f"take_transfers({step}) flushes the store {pair}, which is not in flight",
                [f"expected: one of the stores ordered and not yet landed, {sorted(in_flight)}"],
                Cause("take_transfers flushed a store not in flight"),
            )


ROWS: tuple[Operation, ...] = (
    Operation(
        "land_loads",
        lambda engine, seq: engine.land_loads(seq),
        (("seq", Pick(lambda state: state.landable_ids())),),
        needs=("async_loads",),
        doc="the worker reports a sequence's asynchronous loads done (their step completed; the sequence may have "
        "been freed since): the engine performs them and tells the allocator",
    ),
    Operation(
        "resume",
        lambda engine, seq: engine.resume(seq),
        (("seq", Pick(lambda state: state.ids(Status.LOADED))),),
        needs=("async_loads",),
        doc="schedule a sequence whose loads have landed: the rest of its prompt is allocated and written",
    ),
)
"""The feature's rows of the operation table."""
