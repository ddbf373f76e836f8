"""The engine kvfuzz plays around an allocator: each operation calls the allocator, performs what it orders
(writes, copies, swaps), updates the expected model and the contiguous reference, and checks the invariants.

The harness knows only the contract, never a particular allocator. It is driven by the Hypothesis machine, and can
be driven by hand (a replayed trace, a unit test) through the same methods.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Callable, Optional, TypeVar

from kvfuzz.accounting.occupancy import Occupancy, measure
from kvfuzz.allocator.errors import AllocatorError, Misuse, OutOfBlocks
from kvfuzz.allocator.protocol import AllocatorProtocol
from kvfuzz.allocator.types import NULL_BLOCK, Namespace, SeqId, Tokens
from kvfuzz.reference.contiguous import ContiguousReference
from kvfuzz.statemachines.checks import Checks
from kvfuzz.statemachines.config import MachineConfig
from kvfuzz.statemachines.engine import Engine, SlotWrite
from kvfuzz.statemachines.misuse import MisuseCall
from kvfuzz.statemachines.model import BlockRefs, SeqModel, Status, TableChange, mapped
from kvfuzz.statemachines.violations import Invariant

T = TypeVar("T")


class Harness:
    """One example's engine, model and reference around one allocator."""

    def __init__(
        self,
        allocator: AllocatorProtocol,
        config: MachineConfig,
        stats: Optional[Counter] = None,
        on_step: Optional[Callable[[Occupancy], None]] = None,
    ) -> None:
        self.allocator = allocator
        self.caps = allocator.capabilities
        self.config = config
        self.block_size = allocator.block_size
        self.num_blocks = allocator.num_blocks
        self.num_host_blocks = allocator.num_host_blocks if self.caps.swap else 0
        mismatch = [
            name
            for name, want in (("block_size", config.block_size), ("num_blocks", config.num_blocks))
            if getattr(allocator, name) != want
        ]
        if mismatch:
            raise ValueError(f"allocator geometry {mismatch} differs from the machine config {config}")
        self.engine = Engine(
            config.shape, self.block_size, self.num_blocks, self.num_host_blocks, self.caps.inflight_window
        )
        self.reference = ContiguousReference(config.shape)
        self.seqs: dict[SeqId, SeqModel] = {}
        self.refs = BlockRefs()
        self.finished: list[SeqId] = []
        self.stats = stats if stats is not None else Counter()
        self.check = Checks(self)
        self.on_step = on_step
        self.operation = "setup"
        self._ids = itertools.count()

    # -- queries for the machine ---------------------------------------------------------------------------------

    def new_id(self) -> SeqId:
        return f"s{next(self._ids)}"

    def ids(self, status: Status) -> list[SeqId]:
        return [seq for seq, model in self.seqs.items() if model.status is status]

    def computed_ids(self) -> list[SeqId]:
        """Running sequences whose every token has been written by a step."""
        return [
            seq
            for seq, model in self.seqs.items()
            if model.status is Status.RUNNING
            and model.written == len(self.reference.tokens(seq))
            and not model.awaits_step
        ]

    def length(self, seq: SeqId) -> int:
        return len(self.reference.tokens(seq))

    def host_blocks_in_use(self) -> int:
        return sum(len(mapped(model.host_table)) for model in self.seqs.values())

    def window_start(self, seq: SeqId) -> int:
        """The first position attention reads: 0, or ``len - w`` under a sliding window of w."""
        window = self.caps.sliding_window
        return 0 if window is None else max(0, self.length(seq) - window)

    def rollback_limit(self, seq: SeqId) -> int:
        """The most tokens ``seq`` can drop: one must stay, and no dropped block may come back into the window."""
        limit = self.length(seq) - 1
        window = self.caps.sliding_window
        table = self.seqs[seq].table
        if window is not None and NULL_BLOCK in table:
            first_kept = (len(table) - table[::-1].index(NULL_BLOCK)) * self.block_size
            limit = min(limit, self.length(seq) - window - first_kept)
        return limit

    def scheduled_tags(self) -> dict[int, int]:
        """Slot -> tag of every write the next step makes (the first running sequence's, should two write one slot)."""
        scheduled: dict[int, int] = {}
        for seq, model in self.seqs.items():
            if model.status is Status.RUNNING:
                tags = self.reference.tags(seq)
                for position, slot in self._scheduled_writes(seq):
                    scheduled.setdefault(slot, tags[position])
        return scheduled

    def _take_scheduled_writes(self, seq: SeqId, via: str = "") -> tuple[list[int], list[SlotWrite]]:
        """The slots and writes of ``seq``'s scheduled tokens, each checked exclusive, and mark them written."""
        step = self.engine.next_step
        tags, namespace = self.reference.tags(seq), self.reference.namespace(seq)
        slots, writes = [], []
        for position, slot in self._scheduled_writes(seq):
            self.check.exclusive(slot // self.block_size, seq, f"step {step} writes {seq} position {position}")
            slots.append(slot)
            writes.append(SlotWrite(tags[position], seq, namespace, position, step, via))
        self.seqs[seq].written = len(tags)
        return slots, writes

    def _scheduled_writes(self, seq: SeqId) -> list[tuple[int, int]]:
        """(position, slot) of every token of ``seq`` the next step writes."""
        model, size = self.seqs[seq], self.block_size
        return [
            (position, model.table[position // size] * size + position % size)
            for position in range(model.written, self.length(seq))
            if model.table[position // size] != NULL_BLOCK
        ]

    def occupancy(self) -> Occupancy:
        """The device pool now: blocks referenced by running sequences, their fill, sharing, and the allocator's
        cached, free and pending sets where it exposes them."""
        running = [
            (model.table, self.length(seq)) for seq, model in self.seqs.items() if model.status is Status.RUNNING
        ]
        counts = self.check.counts()
        return measure(
            self.engine.next_step - 1,
            running,
            self.block_size,
            self.num_blocks,
            *((counts.cached, counts.free, counts.pending) if counts is not None else ()),
        )

    # -- operations ----------------------------------------------------------------------------------------------

    def admit(self, seq: SeqId, namespace: Namespace, tokens: Tokens) -> bool:
        """A new request; returns whether it was admitted."""
        self._begin("admit", seq, namespace, tokens)
        result = self._attempt(
            lambda: self.allocator.admit(seq, namespace, tokens), self._blocks(len(tokens)), absent=seq
        )
        if result is None:
            return False
        self.reference.add(seq, namespace, tokens)
        self._admitted(seq, result.block_table, result.num_cached_tokens)
        return True

    def readmit(self, seq: SeqId) -> bool:
        """A preempted request comes back with every token it had; returns whether it was admitted."""
        namespace, tokens = self.reference.namespace(seq), tuple(self.reference.tokens(seq))
        self._begin("readmit", seq)
        result = self._attempt(
            lambda: self.allocator.admit(seq, namespace, tokens), self._blocks(len(tokens)), absent=seq
        )
        if result is None:
            return False
        self._admitted(seq, result.block_table, result.num_cached_tokens)
        return True

    def grow(self, seq: SeqId, tokens: Tokens) -> bool:
        """Append tokens (decode, a chunk, speculative drafts); returns whether the allocator found room."""
        model = self.seqs[seq]
        old_len = self.length(seq)
        self._begin("grow", seq, tokens)
        needed = self._blocks(old_len + len(tokens)) - len(model.table) + (old_len % self.block_size != 0)
        result = self._attempt(lambda: self.allocator.grow(seq, tokens), needed)
        if result is None:
            return False
        for copy in result.copies:
            self.engine.copy_block(copy.src, copy.dst)
            self.stats["copy-on-write copies"] += 1
        self.reference.extend(seq, tokens)
        table = self._table(seq)
        size = self.block_size
        for position, slot in enumerate(result.slots, start=old_len):
            want = (table[position // size], position % size)
            if (slot.block, slot.offset) != want:
                self.check.fail(
                    Invariant.CONTENT,
                    f"grow returned slot (block {slot.block}, offset {slot.offset}) for {seq} position {position}",
                    [f"expected: (block {want[0]}, offset {want[1]}) as its block table says: {list(table)}"],
                )
        if len(result.slots) != len(tokens):
            self.check.fail(Invariant.CONTENT, f"grow of {len(tokens)} tokens returned {len(result.slots)} slots")
        self._settle(self._set_table(seq, table, "grown into"))
        for copy in result.copies:
            self.check.exclusive(copy.dst, seq, f"copy-on-write copy from block {copy.src}")
        targets = self._write_targets(seq, table, old_len)
        for index, block in targets.items():
            self.check.exclusive(block, seq, f"grow schedules writes of {seq}'s logical block {index}")
        self.check.window(set(targets.values()) | {copy.dst for copy in result.copies}, seq)
        return True

    def fork(self, parent: SeqId, child: SeqId) -> bool:
        """Parallel sampling or beam search: ``child`` shares all of ``parent``'s blocks, or gets the copies the
        allocator returned (then its table differs from the parent's exactly at their destinations)."""
        self._begin("fork", parent, child)
        needed = int(self.caps.fork_copies and self.length(parent) % self.block_size != 0)
        copies = self._attempt(lambda: tuple(self.allocator.fork(parent, child) or ()), needed, absent=child)
        if copies is None:
            return False
        if copies and not self.caps.fork_copies:
            self.check.fail(
                Invariant.REFCOUNTS,
                f"fork of {parent} into {child} returned copies {list(copies)}",
                ["expected: none: the allocator does not declare fork_copies, so fork shares every block"],
            )
        for copy in copies:
            self.engine.copy_block(copy.src, copy.dst)
            self.stats["fork copies"] += 1
        self.reference.fork(parent, child)
        self.seqs[child] = SeqModel(
            child, Status.RUNNING, written=self.seqs[parent].written, joined_step=self.engine.next_step
        )
        table = self._table(child)
        expected = tuple({copy.src: copy.dst for copy in copies}.get(block, block) for block in self.seqs[parent].table)
        if table != expected:
            self.check.fail(
                Invariant.REFCOUNTS,
                f"fork gave {child} a block table unlike its parent {parent}'s",
                [f"expected: {list(expected)} (shared, or the copies it ordered)", f"found:    {list(table)}"],
            )
        size = self.block_size
        written = self.seqs[child].written
        moved = [index for index, (old, new) in enumerate(zip(self.seqs[parent].table, table)) if old != new]
        self._settle(
            self._set_table(child, table, "shared by fork with"),
            [(child, p) for index in moved for p in range(index * size, min((index + 1) * size, written))],
        )
        for copy in copies:
            self.check.exclusive(copy.dst, child, f"fork copy from block {copy.src}")
        self.check.window({copy.dst for copy in copies}, child)
        self.stats["forks"] += 1
        return True

    def free(self, seq: SeqId) -> None:
        """The request finished or was cancelled (possibly before its first step).

        Under ``matchable_when_scheduled`` the step its tokens were scheduled for runs in full, abort or not: their
        writes land first."""
        self._begin("free", seq)
        if self.caps.matchable_when_scheduled and self.seqs[seq].status is Status.RUNNING:
            slots, writes = self._take_scheduled_writes(seq, "scheduled before the abort")
            if slots:
                self.engine.write(slots, writes)
        self._call(lambda: self.allocator.free(seq))
        change = self._set_table(seq, (), "released (free) by")
        del self.seqs[seq]
        self.reference.remove(seq)
        self.finished.append(seq)
        self._settle(change)

    def preempt(self, seq: SeqId) -> None:
        """Release a running sequence for recomputation; it keeps its tokens and waits to be readmitted."""
        self._begin("preempt", seq)
        self._call(lambda: self.allocator.preempt(seq))
        change = self._set_table(seq, (), "released (preempt) by")
        self.seqs[seq].status, self.seqs[seq].written = Status.PREEMPTED, 0
        self._settle(change)

    def swap_out(self, seq: SeqId) -> bool:
        """Move a running sequence's K/V to the host pool."""
        model = self.seqs[seq]
        self._begin("swap_out", seq)
        live = mapped(model.table)
        result = self._attempt(lambda: self.allocator.swap_out(seq), len(live), host=True)
        if result is None:
            return False
        host_of = dict(result.mapping)
        if sorted(host_of) != sorted(live) or len(result.mapping) != len(live):
            self.check.fail(
                Invariant.CONTENT,
                f"swap-out of {seq} maps device blocks {sorted(host_of)}",
                [f"expected: the blocks of its table {list(model.table)}, each once"],
            )
        in_use = {block for other in self.seqs.values() for block in mapped(other.host_table)}
        clash = sorted(set(host_of.values()) & in_use)
        if clash or len(set(host_of.values())) != len(host_of):
            self.check.fail(
                Invariant.CONTENT,
                f"swap-out of {seq} reuses host block(s) {clash or host_of}",
                ["expected: distinct host blocks no other swapped-out sequence holds"],
            )
        for block, host_block in result.mapping:
            self.engine.swap_to_host(block, host_block)
        host_table = tuple(host_of.get(block, NULL_BLOCK) for block in model.table)
        change = self._set_table(seq, (), "released (swap-out) by")
        model.status, model.host_table = Status.SWAPPED, host_table
        self.stats["swapped out blocks"] += len(live)
        self._settle(change)
        return True

    def swap_in(self, seq: SeqId) -> bool:
        """Bring a swapped-out sequence back to the device."""
        model = self.seqs[seq]
        self._begin("swap_in", seq)
        swapped = sorted(mapped(model.host_table))
        result = self._attempt(lambda: self.allocator.swap_in(seq), len(swapped))
        if result is None:
            return False
        if sorted(src for src, _ in result.mapping) != swapped:
            self.check.fail(
                Invariant.CONTENT,
                f"swap-in of {seq} copies host blocks {sorted(src for src, _ in result.mapping)}",
                [f"expected: the host blocks it was swapped out to, {list(model.host_table)}"],
            )
        for host_block, block in result.mapping:
            self.engine.swap_from_host(host_block, block)
        model.status, model.host_table, model.joined_step = Status.RUNNING, (), self.engine.next_step
        table = self._table(seq)
        change = self._set_table(seq, table, "swapped in for")
        self._settle(change, positions=[(seq, position) for position in range(self.window_start(seq), model.written)])
        for _, block in result.mapping:
            self.check.exclusive(block, seq, "swap-in copy")
        self.check.window({block for _, block in result.mapping}, seq)
        self.stats["swapped in blocks"] += len(result.mapping)
        return True

    def rollback(self, seq: SeqId, num_tokens: int) -> None:
        """Drop the last tokens (rejected speculative drafts)."""
        self._begin("rollback", seq, num_tokens)
        self._call(lambda: self.allocator.rollback(seq, num_tokens))
        model = self.seqs[seq]
        new_len = self.length(seq) - num_tokens
        self.reference.truncate(seq, new_len)
        model.written = min(model.written, new_len)
        self._settle(self._set_table(seq, self._table(seq), "kept after rollback by"))

    def evict(self, num_blocks: int) -> None:
        self._begin("evict", num_blocks)
        before = set(self.allocator.cached_blocks()) if self.caps.introspection else set()
        dropped = self._call(lambda: self.allocator.evict(num_blocks))
        if not 0 <= dropped <= num_blocks:
            self.check.fail(
                Invariant.FREE_SET,
                f"evict({num_blocks}) reports {dropped} blocks dropped",
                [f"expected: between 0 and {num_blocks}"],
            )
        self.stats["evicted blocks"] += dropped
        evicted = before - set(self.allocator.cached_blocks()) if self.caps.introspection else set()
        for block in evicted:
            self.engine.note(block, "evicted from the cache")
        self._settle(TableChange(frozenset(evicted), (), ()))

    def reset_cache(self) -> None:
        self._begin("reset_cache")
        self._call(self.allocator.reset_cache)
        if self.caps.introspection and len(self.allocator.cached_blocks()):
            self.check.fail(
                Invariant.FREE_SET,
                f"reset_cache left {len(self.allocator.cached_blocks())} cached unreferenced block(s)",
                ["expected: none"],
            )
        self._settle(TableChange(frozenset(), (), ()))

    def step(self) -> int:
        """One forward pass: write the K/V of every new token, then every running sequence attends."""
        self._begin("step")
        step = self.engine.next_step
        slots, writes = [], []
        for seq, model in self.seqs.items():
            if model.status is Status.RUNNING:
                seq_slots, seq_writes = self._take_scheduled_writes(seq)
                slots += seq_slots
                writes += seq_writes
        self.engine.launch_step()
        if slots:
            self.engine.write(slots, writes)
        for model in self.seqs.values():
            model.awaits_step = False
        self.stats["tokens written"] += len(slots)
        self.check.content(self.engine.take_dirty())
        self.check.attention()
        self._complete(self.engine.steps_to_complete())
        if self.on_step is not None:
            self.on_step(self.occupancy())
        return step

    def misuse(self, call: MisuseCall) -> None:
        """A call that breaks the contract: it must raise a Misuse error and change nothing."""
        self._begin("misuse", call)
        before = self.check.counts()
        try:
            getattr(self.allocator, call.op)(*call.args)
        except Misuse as error:
            self.check.unchanged(Invariant.MISUSE, before, error)
        except Exception as error:  # noqa: BLE001 -- any other exception type is the finding
            self.check.fail(
                Invariant.MISUSE,
                f"{call} ({call.why}) raised {type(error).__name__}: {error}",
                ["expected: a kvfuzz.allocator.errors.Misuse subclass, with nothing changed"],
            )
        else:
            self.check.fail(
                Invariant.MISUSE,
                f"{call} ({call.why}) was accepted silently",
                ["expected: a kvfuzz.allocator.errors.Misuse subclass, with nothing changed"],
            )
        self.stats["misuse calls refused"] += 1

    def dismiss(self, seq: SeqId) -> None:
        """The engine is done with ``seq`` wherever it is (cancelled, or the run ends): a preempted sequence holds no
        blocks and is forgotten without calling the allocator; any other is freed."""
        if self.seqs[seq].status is Status.PREEMPTED:
            del self.seqs[seq]
            self.reference.remove(seq)
        else:
            self.free(seq)

    def quiesce(self) -> None:
        """Invariant 10: once every sequence is gone and the in-flight work done, every block is free."""
        for seq in list(self.seqs):
            self.dismiss(seq)
        self._begin("quiesce")
        self._complete(self.engine.steps_to_complete(drain=True))
        while self.engine.late_work_by_block:
            self.engine.launch_step()
            self._complete(self.engine.steps_to_complete(drain=True))
        if self.caps.eviction:
            self._call(self.allocator.reset_cache)
        if self.caps.introspection:
            self.check.accounting(())
            self.check.quiescent()
        else:
            self._probe_whole_pool()

    # -- the engine's side of each operation ---------------------------------------------------------------------

    def _begin(self, op: str, *args: object) -> None:
        self.operation = (
            f"{op}({', '.join(repr(arg) if not isinstance(arg, MisuseCall) else str(arg) for arg in args)})"
        )
        self.stats[op] += 1

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _call(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except AllocatorError as error:
            self.check.fail(
                Invariant.MISUSE,
                f"a valid call was refused with {type(error).__name__}: {error}",
                ["expected: the call to succeed"],
            )

    def _attempt(
        self, call: Callable[[], T], needed: int, absent: Optional[SeqId] = None, host: bool = False
    ) -> Optional[T]:
        """Run an operation that may be refused for lack of space; check a refusal is clean and justified."""
        before = self.check.counts()
        try:
            result = call()
        except OutOfBlocks as error:
            self.stats["refused (out of blocks)"] += 1
            self.check.unchanged(Invariant.ATOMIC_REFUSAL, before, error, absent)
            self.check.not_false(needed, error, host)
            return None
        except AllocatorError as error:
            self.check.fail(
                Invariant.MISUSE,
                f"a valid call was refused with {type(error).__name__}: {error}",
                ["expected: the call to succeed, or OutOfBlocks"],
            )
        return result

    def _table(self, seq: SeqId) -> tuple[int, ...]:
        table = tuple(self.allocator.block_table(seq))
        self.check.table_shape(seq, table)
        return table

    def _admitted(self, seq: SeqId, reported: tuple[int, ...], num_cached: int) -> None:
        model = self.seqs.setdefault(seq, SeqModel(seq, Status.RUNNING))
        model.joined_step = self.engine.next_step
        model.status, model.written = Status.RUNNING, num_cached
        table = self._table(seq)
        if table != tuple(reported):
            self.check.fail(
                Invariant.CONTENT,
                f"admit returned block table {list(reported)} for {seq}",
                [f"found: block_table({seq!r}) says {list(table)}"],
            )
        self.check.accounting(self._set_table(seq, table, "admitted as").touched)
        model.awaits_step = self.check.cache_hit(seq, num_cached)
        targets = self._write_targets(seq, table, num_cached)
        for index, block in targets.items():
            self.check.exclusive(block, seq, f"admit schedules writes of {seq}'s logical block {index}")
        self.check.window(targets.values(), seq)
        if num_cached:
            self.stats["cache hits"] += 1
            self.stats["cache-hit tokens"] += num_cached
        self.check.content(self.engine.take_dirty())

    def _write_targets(self, seq: SeqId, table: tuple[int, ...], first_position: int) -> dict[int, int]:
        """Logical index -> block of every block the next step writes, from ``first_position`` on (dropped
        entries are never written)."""
        return {
            index: table[index]
            for index in range(first_position // self.block_size, len(table))
            if table[index] != NULL_BLOCK
        }

    def _set_table(self, seq: SeqId, table: tuple[int, ...], event: str) -> TableChange:
        """Record ``seq``'s new table; released blocks start their in-flight window."""
        model = self.seqs[seq]
        old = model.table
        change = self.refs.replace(seq, old, table)
        model.table = table
        for index, block in enumerate(table):
            if index >= len(old) or old[index] != block:
                self.engine.note(block, f"{event} {seq} as logical block {index}")
        for block in change.released:
            self.engine.note(block, f"{event} {seq}")
            self.engine.release(block, seq)
        return change

    def _settle(self, change: TableChange, positions: list[tuple[SeqId, int]] = ()) -> None:
        """After an operation: content of what it touched, then refcounts and the free set."""
        self.check.content(self.engine.take_dirty(), positions)
        self.check.accounting(change.touched)

    def _complete(self, steps: list[int]) -> None:
        for step in steps:
            self.engine.complete_step(step)
            self._call(lambda: self.allocator.step_completed(step))
            if self.caps.remaps_on_step:
                self._adopt_remaps()
        self.check.content(self.engine.take_dirty())

    def _adopt_remaps(self) -> None:
        """An allocator that declares ``remaps_on_step`` may swap a running sequence's block for one holding the same
        K/V when a step completes (de-duplication): every new table is adopted, then every written position that
        moved is checked bit for bit, with refcounts and the free set."""
        size = self.block_size
        touched, positions = set(), []
        for seq, model in list(self.seqs.items()):
            if model.status is not Status.RUNNING:
                continue
            table = self._table(seq)
            if table == model.table:
                continue
            moved = [index for index, (old, new) in enumerate(zip(model.table, table)) if old != new]
            touched |= self._set_table(seq, table, "remapped at step completion for").touched
            self.stats["remapped blocks"] += len(moved)
            positions += [
                (seq, p) for index in moved for p in range(index * size, min((index + 1) * size, model.written))
            ]
        if touched:
            self.check.content(self.engine.take_dirty(), positions)
            self.check.accounting(touched)

    def _probe_whole_pool(self) -> None:
        """Without introspection, leaks show as a refusal: one sequence must fit in the whole pool."""
        usable = self.num_blocks - self.caps.reserved_blocks
        probe = self.new_id()
        tokens = tuple(itertools.islice(itertools.cycle(range(97, 101)), usable * self.block_size))
        try:
            self.allocator.admit(probe, ("kvfuzz-quiescence-probe",), tokens)
        except OutOfBlocks as error:
            self.check.fail(
                Invariant.QUIESCENCE,
                f"every sequence is gone, yet a {usable}-block sequence is refused: {error}",
                ["some blocks leaked"],
            )
        self.allocator.free(probe)
