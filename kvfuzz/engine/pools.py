"""The K/V pools the engine writes: physical device and host pools on a torch device, shadow records of who wrote
every slot, and steps that run up to W (the in-flight window) ahead of their completion.

kvfuzz writes and copies K/V only where the allocator says. Every slot's shadow record names the write that put its
content there, so a wrong read can be traced to the sequence, position and step that produced it. Work in flight
when a block is released (the last steps' writes, a swap copy, an offload job) may land as late as the completion of
step c + W, where c was the last completed step at the release: the engine makes it land exactly then, after any
newer write, so a block handed out again too early is observably corrupted.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Optional

import attrs
import torch

from kvfuzz.allocator.types import Namespace, SeqId
from kvfuzz.engine.groups import shown_namespace
from kvfuzz.reference.content import ModelShape, kv_for_tags

_HISTORY_LENGTH = 8

UNTIL_LOADS_LAND = 1 << 62
"""A step no run reaches: the ``read_until`` / ``held_until`` of a block an asynchronous load still fills (or whose
loading sequence was freed), until the engine reports that load landed and :meth:`KVPools.lift` ends the hold."""


@attrs.frozen
class SlotWrite:
    """The write whose K/V a slot holds: the K/V of ``seq``'s prefix up to ``position``.

    ``step`` is the step whose work put it in this slot (the write, or the copy that brought it); ``via`` says how
    it got here when that was not a direct write.
    """

    tag: int
    seq: SeqId
    namespace: Namespace
    position: int
    step: int
    via: str = ""

    def describe(self) -> str:
        how = f" ({self.via})" if self.via else ""
        return (
            f"K/V of sequence {self.seq} (namespace {shown_namespace(self.namespace)}) position {self.position}, "
            f"put here by step {self.step}{how}"
        )


@attrs.frozen
class PoolEvent:
    """One change the engine made to a block's K/V, for an observer (the timeline of ``kvfuzz show``).

    ``kind`` is ``write`` (a step's writes), ``copy`` (copy-on-write or fork copy), ``swap-out`` (``block`` is then
    a host block; a host-tier store too), ``swap-in`` (``source`` is then a host block; a host-tier load too) or
    ``land`` (late in-flight work landed); ``writes`` lists, for each slot of ``block`` changed, its offset and the
    write it now holds.
    """

    kind: str  # write, copy, swap-out, swap-in or land
    block: int  # the block whose slots changed (a host block for swap-out)
    source: Optional[int]  # the block copied from (a host block for swap-in), None for write and land
    writes: tuple[tuple[int, SlotWrite], ...]  # (offset, record) of every slot changed


@attrs.frozen
class LateWork:
    """In-flight work on a released block: it lands when step ``lands_at`` completes and rewrites what it held.
    ``writes`` are the block's records then, by offset: their K/V are their tags', as the pools keep every recorded
    slot's, so the landing makes them from the tags instead of keeping a copy of the block's rows."""

    block: int
    released_by: SeqId
    released_at: int
    lands_at: int
    writes: tuple[tuple[int, SlotWrite], ...]


class KVPools:
    """Physical pools, shadow records, steps and late in-flight work for one example.

    Invariant kept: ``shadow[slot]`` names the write whose K/V ``keys[slot]``/``values[slot]`` hold (the K/V of its
    tag, bit for bit: every write, copy and landing changes a slot's rows and record together), and no slot without a
    record was ever written; every block in ``late_work_by_block`` has work that lands exactly when step
    ``lands_at`` completes.
    """

    def __init__(
        self, shape: ModelShape, block_size: int, num_blocks: int, num_host_blocks: int, inflight_window: int
    ) -> None:
        self.shape = shape  # layers, heads, head dim, dtype and device of every K/V row
        self.block_size = block_size  # slots per block: slot = block * block_size + offset
        self.inflight_window = inflight_window  # W: steps a released block's in-flight work may still land
        row = shape.kv_row_shape
        # Zero-initialised, as engines allocate their caches: a kernel whose mask multiplies unread slots by a zero
        # weight (eager FlexAttention) must not meet NaN left by torch.empty. A read of an unwritten slot is still
        # invariant 1's to report: the shadow records know nothing was written there.
        self.keys = torch.zeros((num_blocks * block_size, *row), dtype=shape.dtype, device=shape.device)
        self.values = torch.zeros_like(self.keys)
        self.host_keys = torch.zeros((num_host_blocks * block_size, *row), dtype=shape.dtype, device=shape.device)
        self.host_values = torch.zeros_like(self.host_keys)
        self.shadow: dict[int, SlotWrite] = {}  # device slot -> the write whose K/V it holds
        self.host_shadow: dict[int, SlotWrite] = {}  # host slot -> the write whose K/V it holds
        self.next_step = 0  # the step being scheduled: launched by the next step()
        self.last_completed = -1  # the newest step that has completed on the device (-1: none yet)
        self._in_flight: deque[int] = deque()  # launched steps not yet completed, oldest first
        self._late_work: dict[int, list[LateWork]] = {}  # step -> late work that lands when it completes
        self.late_work_by_block: dict[int, LateWork] = {}  # released block -> its pending late work
        # Block -> the step that may still read it for a sequence freed before that step launched (under host_cache
        # the step still runs), or that lands a host-tier load into it: a release of the block keeps it in flight
        # until then.
        self.read_until: dict[int, int] = {}
        # Released block -> the step until whose completion the allocator may hold it pending though no late work
        # lands on it, and may still hand it out (under host_cache, the prefix a load not yet landed extends).
        self.held_until: dict[int, int] = {}
        # Released block held until an asynchronous load lands (UNTIL_LOADS_LAND) -> the step its own in-flight
        # window would have ended at without that hold.
        self._window_after_hold: dict[int, int] = {}
        self.history: dict[int, deque[str]] = {}  # block -> its latest events, for explanations
        # Unreferenced blocks the allocator listed as cached when the checks last looked: one handed out for writing
        # was evicted first, which its history says.
        self.seen_cached: set[int] = set()
        self.dirty: set[int] = set()  # device slots written or copied since the checks last looked
        self.observer: Optional[Callable[[PoolEvent], None]] = None  # told of every write, copy and landing

    def close(self) -> None:
        """Release the pools' memory; nothing may be written or read afterwards."""
        empty = self.keys.new_empty((0, *self.keys.shape[1:]))
        self.keys = self.values = self.host_keys = self.host_values = empty
        self._late_work.clear()
        self.late_work_by_block.clear()

    def block_tags(self, block: int) -> tuple[Optional[int], ...]:
        """The tag of the K/V each slot of a device block holds (None: never written): what the block holds,
        whichever sequence wrote it."""
        first = block * self.block_size
        return tuple(
            None if (record := self.shadow.get(slot)) is None else record.tag
            for slot in range(first, first + self.block_size)
        )

    # -- writes and copies ---------------------------------------------------------------------------------------

    def write(self, slots: list[int], writes: list[SlotWrite]) -> None:
        """Write the K/V of each tagged position into its slot (the writes of the step being launched)."""
        keys, values = kv_for_tags([w.tag for w in writes], self.shape)
        index = torch.tensor(slots, device=self.keys.device)
        self.keys[index] = keys
        self.values[index] = values
        self.shadow.update(zip(slots, writes))
        self.dirty.update(slots)
        if self.observer is not None:
            by_block: dict[int, list[tuple[int, SlotWrite]]] = {}
            for slot, record in zip(slots, writes):
                by_block.setdefault(slot // self.block_size, []).append((slot % self.block_size, record))
            for block, changed in by_block.items():
                self.observer(PoolEvent("write", block, None, tuple(changed)))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: the whole of block ``src`` into block ``dst``, as part of the next step's work."""
        self._copy(
            self.keys,
            self.values,
            self.shadow,
            src,
            self.keys,
            self.values,
            self.shadow,
            dst,
            f"copied from block {src}",
            "copy",
        )

    def swap_to_host(self, block: int, host_block: int, via: str = "") -> None:
        """Copy device block ``block`` into host block ``host_block`` (a swap-out, or a host-tier store)."""
        self._copy(
            self.keys,
            self.values,
            self.shadow,
            block,
            self.host_keys,
            self.host_values,
            self.host_shadow,
            host_block,
            via or f"swapped out from block {block}",
            "swap-out",
            mark_dirty=False,
        )

    def swap_from_host(self, host_block: int, block: int, via: str = "", step: Optional[int] = None) -> None:
        """Copy host block ``host_block`` into device block ``block`` (a swap-in, or a host-tier load) as part of step
        ``step`` (default: the next step; an asynchronous load reported landed was part of a completed one)."""
        self._copy(
            self.host_keys,
            self.host_values,
            self.host_shadow,
            host_block,
            self.keys,
            self.values,
            self.shadow,
            block,
            via or f"swapped in from host block {host_block}",
            "swap-in",
            step=step,
        )

    def _copy(
        self,
        src_keys: torch.Tensor,
        src_values: torch.Tensor,
        src_shadow: dict[int, SlotWrite],
        src: int,
        dst_keys: torch.Tensor,
        dst_values: torch.Tensor,
        dst_shadow: dict[int, SlotWrite],
        dst: int,
        via: str,
        kind: str,
        mark_dirty: bool = True,
        step: Optional[int] = None,
    ) -> None:
        size = self.block_size
        src_rows, dst_rows = slice(src * size, (src + 1) * size), slice(dst * size, (dst + 1) * size)
        dst_keys[dst_rows] = src_keys[src_rows]
        dst_values[dst_rows] = src_values[src_rows]
        for offset in range(size):
            record = src_shadow.get(src * size + offset)
            if record is None:
                dst_shadow.pop(dst * size + offset, None)
            else:
                dst_shadow[dst * size + offset] = attrs.evolve(
                    record, step=self.next_step if step is None else step, via=via
                )
        if mark_dirty:
            self.dirty.update(range(dst * size, (dst + 1) * size))
        if self.observer is not None:
            changed = tuple(
                (offset, dst_shadow[dst * size + offset]) for offset in range(size) if dst * size + offset in dst_shadow
            )
            self.observer(PoolEvent(kind, dst, src, changed))

    # -- steps and late work -------------------------------------------------------------------------------------

    def launch_step(self) -> int:
        """Start the next step; its writes have landed when this returns."""
        step = self.next_step
        self.next_step += 1
        self._in_flight.append(step)
        return step

    def steps_to_complete(self, drain: bool = False) -> list[int]:
        """The in-flight steps that complete now: all beyond the window (or all of them when draining)."""
        keep = 0 if drain else self.inflight_window
        done = []
        while len(self._in_flight) > keep:
            done.append(self._in_flight.popleft())
        return done

    def complete_step(self, step: int) -> list[int]:
        """Step ``step`` completes: the late work due now lands, after every newer write. Returns the blocks whose
        in-flight window closed."""
        self.last_completed = step
        closed = [block for block, until in self.held_until.items() if until <= step]
        for block in closed:
            del self.held_until[block]
        for work in self._late_work.pop(step, ()):
            if self.late_work_by_block.get(work.block) is work:
                del self.late_work_by_block[work.block]
                closed.append(work.block)
            self._land(work)
        return closed

    def release(self, block: int, seq: SeqId) -> None:
        """No live sequence references ``block`` any more; work in flight on it may still land later: the writes of
        steps not yet completed (a completed step's writes have landed, and cannot overtake a later one, such as a
        host-tier load ordered before the release). The window lasts at least until ``read_until[block]``, and no
        shorter than a window the block is still in."""
        earlier = self.late_work_by_block.get(block)  # a window still open from an earlier release
        own_window = self.last_completed + self.inflight_window
        if earlier is not None and earlier.lands_at != UNTIL_LOADS_LAND:
            own_window = max(own_window, earlier.lands_at)
        lands_at = max(own_window, self.read_until.pop(block, -1), earlier.lands_at if earlier is not None else -1)
        if lands_at == UNTIL_LOADS_LAND:
            self._window_after_hold[block] = max(own_window, self._window_after_hold.get(block, -1))
        if lands_at <= self.last_completed:
            return
        size = self.block_size
        writes = tuple(
            (offset, record)
            for offset in range(size)
            if (record := self.shadow.get(block * size + offset)) is not None and record.step > self.last_completed
        )
        work = LateWork(block, seq, self.next_step, lands_at, writes)
        self._late_work.setdefault(lands_at, []).append(work)
        self.late_work_by_block[block] = work

    def lift(self, blocks: Iterable[int]) -> list[int]:
        """An asynchronous load into (or next to) ``blocks`` is reported landed: their holds until then end. A
        released one stays in flight (not to be handed out) only as long as its own window from its release lasts,
        but may be held pending for a window from now, as an allocator that frees it only now does. Returns the
        blocks whose window closed."""
        closed = []
        pending_until = self.last_completed + self.inflight_window
        for block in blocks:
            if self.held_until.get(block) == UNTIL_LOADS_LAND:
                del self.held_until[block]
                closed.append(block)
                if pending_until > self.last_completed:
                    self.held_until[block] = pending_until
            if self.read_until.get(block) == UNTIL_LOADS_LAND:
                del self.read_until[block]  # still referenced: its release starts an ordinary window
            work = self.late_work_by_block.get(block)
            if work is None or work.lands_at != UNTIL_LOADS_LAND:
                continue
            self._late_work[UNTIL_LOADS_LAND].remove(work)
            del self.late_work_by_block[block]
            window = self._window_after_hold.pop(block)
            if window > self.last_completed:
                work = attrs.evolve(work, lands_at=window)
                self._late_work.setdefault(window, []).append(work)
                self.late_work_by_block[block] = work
            else:
                self._land(work)
                closed.append(block)
                if pending_until > self.last_completed:
                    self.held_until[block] = pending_until
        if not self._late_work.get(UNTIL_LOADS_LAND, True):
            del self._late_work[UNTIL_LOADS_LAND]
        return closed

    def _land(self, work: LateWork) -> None:
        size = self.block_size
        landed: list[tuple[int, SlotWrite]] = []
        for offset, record in work.writes:
            slot = work.block * size + offset
            current = self.shadow.get(slot)
            if current is not None and current.tag == record.tag:
                continue
            self.shadow[slot] = attrs.evolve(
                record,
                via=f"late in-flight work from before block {work.block} was released by "
                f"{work.released_by} at step {work.released_at}, landing as step {work.lands_at} "
                f"completed",
            )
            landed.append((offset, self.shadow[slot]))
        if not landed:
            return
        slots = [work.block * size + offset for offset, _ in landed]
        keys, values = kv_for_tags([record.tag for _, record in landed], self.shape)
        index = torch.tensor(slots, device=self.keys.device)
        self.keys[index] = keys
        self.values[index] = values
        self.dirty.update(slots)
        if self.observer is not None:
            self.observer(PoolEvent("land", work.block, None, tuple(landed)))

    # -- provenance ----------------------------------------------------------------------------------------------

    def note(self, block: int, event: str) -> None:
        """Record an event in the block's short history, for explanations."""
        self.history.setdefault(block, deque(maxlen=_HISTORY_LENGTH)).append(f"step {self.next_step}: {event}")

    def block_story(self, block: int) -> list[str]:
        events = self.history.get(block)
        if not events:
            return [f"block {block} history: (no events recorded)"]
        return [f"block {block} history (latest last):"] + [f"  {event}" for event in events]

    def take_dirty(self) -> set[int]:
        dirty, self.dirty = self.dirty, set()
        return dirty

    def record(self, slot: int) -> Optional[SlotWrite]:
        return self.shadow.get(slot)

    def rows(self, slots: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(list(slots), device=self.keys.device)
        return self.keys[index], self.values[index]
