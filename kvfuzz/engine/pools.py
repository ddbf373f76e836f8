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
from typing import Callable, Iterable, Optional, Sequence

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

    The shadow records are the pools' content: ``shadow[slot]`` names the write whose K/V the slot holds, and a slot
    without a record holds zeros (nothing was ever written there). The tensors (``keys``, ``values``, ``host_keys``,
    ``host_values``) are made from the records only when something reads them (a kernel other than the gather
    kernel's tag check, or invariant 1's bitwise comparison once they exist), and then kept: a write, copy or landing
    changes the records and marks the slots it changed stale, and the next read of a tensor rebuilds those rows from
    their records (the K/V of the record's tag, bit for bit, or zeros). Under the gather kernel a passing example
    never makes them.

    Invariant kept: once made, every row of the tensors not in ``_stale`` (``_host_stale``) holds its slot's record's
    K/V, unless something outside the pools wrote into the tensors it was given; every block in
    ``late_work_by_block`` has work that lands exactly when step ``lands_at`` completes.
    """

    def __init__(
        self, shape: ModelShape, block_size: int, num_blocks: int, num_host_blocks: int, inflight_window: int
    ) -> None:
        self.shape = shape  # layers, heads, head dim, dtype and device of every K/V row
        self.block_size = block_size  # slots per block: slot = block * block_size + offset
        self.inflight_window = inflight_window  # W: steps a released block's in-flight work may still land
        self._num_slots = num_blocks * block_size  # rows of the device pool
        self._num_host_slots = num_host_blocks * block_size  # rows of the host pool
        # The device pool's K and V, and the host pool's, once made (None until something reads them).
        self._device: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._host: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._stale: set[int] = set()  # device slots whose records changed since the device tensors were updated
        self._host_stale: set[int] = set()  # the same for the host pool
        self.shadow: dict[int, SlotWrite] = {}  # device slot -> the write whose K/V it holds
        # Device slot -> tags of the K/V it held when the allocator listed its block free, until a write lands there
        # (less those a table that took the block fresh is to write): a cache entry for one outlived the release.
        self.freed_tags: dict[int, set[int]] = {}
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
        # Block -> its latest events, for explanations: (step, text, its arguments), made into text by block_story.
        self.history: dict[int, deque[tuple[int, str, tuple[object, ...]]]] = {}
        # Unreferenced blocks the allocator listed as cached when the checks last looked: one handed out for writing
        # was evicted first, which its history says.
        self.seen_cached: set[int] = set()
        # Device block -> the operation that withdrew writes scheduled into it (a preemption, an abort), until a write
        # or copy lands in it: a cache that offers it offers K/V no step wrote.
        self.withdrawn: dict[int, str] = {}
        # Device block -> the step being scheduled when a table last took it fresh (not by a cache hit): K/V written
        # before then is of the block's earlier life.
        self.acquired_at: dict[int, int] = {}
        self.dirty: set[int] = set()  # device slots written or copied since the checks last looked
        self.observer: Optional[Callable[[PoolEvent], None]] = None  # told of every write, copy and landing

    def close(self) -> None:
        """Release the pools' memory; nothing may be written or read afterwards. The records and histories go too:
        the engine's objects refer to one another, so what they hold would otherwise wait for the garbage
        collector (a program's thousands of records, found in its young generations again and again)."""
        self._num_slots = self._num_host_slots = 0
        self._device = self._host = None
        self._stale.clear()
        self._host_stale.clear()
        self._late_work.clear()
        self.late_work_by_block.clear()
        self.shadow.clear()
        self.host_shadow.clear()
        self.history.clear()
        self.read_until.clear()
        self.held_until.clear()
        self.dirty.clear()

    # -- the tensors, made from the records when read ------------------------------------------------------------

    @property
    def keys(self) -> torch.Tensor:
        """The device pool's K, ``[num_blocks * block_size, layers, kv_heads, head_dim]`` (made or brought up to date
        from the records now)."""
        return self._device_tensors()[0]

    @property
    def values(self) -> torch.Tensor:
        """The device pool's V, as :attr:`keys`."""
        return self._device_tensors()[1]

    @property
    def host_keys(self) -> torch.Tensor:
        """The host pool's K, ``[num_host_blocks * block_size, ...]`` (made or brought up to date now)."""
        return self._host_tensors()[0]

    @property
    def host_values(self) -> torch.Tensor:
        """The host pool's V, as :attr:`host_keys`."""
        return self._host_tensors()[1]

    @property
    def made(self) -> bool:
        """Whether the device tensors exist (something has read them in this example)."""
        return self._device is not None

    def _device_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._device is None:
            self._device = self._made(self._num_slots, self.shadow)
            self._stale.clear()
        elif self._stale:
            self._update(self._device, self._stale, self.shadow)
        return self._device

    def _host_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._host is None:
            self._host = self._made(self._num_host_slots, self.host_shadow)
            self._host_stale.clear()
        elif self._host_stale:
            self._update(self._host, self._host_stale, self.host_shadow)
        return self._host

    def _made(self, slots: int, shadow: dict[int, SlotWrite]) -> tuple[torch.Tensor, torch.Tensor]:
        """A pool of ``slots`` rows holding its records' K/V. Zero where there is none, as engines allocate their
        caches: a kernel whose mask multiplies unread slots by a zero weight (eager FlexAttention) must not meet NaN
        left by torch.empty. A read of an unwritten slot is still invariant 1's to report: the records know nothing
        was written there."""
        shape = self.shape
        keys = torch.zeros((slots, *shape.kv_row_shape), dtype=shape.dtype, device=shape.device)
        values = torch.zeros_like(keys)
        recorded = [slot for slot in shadow if slot < slots]
        if recorded:
            self._rewrite((keys, values), recorded, shadow)
        return keys, values

    def _update(
        self, tensors: tuple[torch.Tensor, torch.Tensor], stale: set[int], shadow: dict[int, SlotWrite]
    ) -> None:
        """Rows of ``stale`` slots rebuilt from their records (zeros where a copy left none); ``stale`` emptied."""
        recorded = [slot for slot in stale if slot in shadow]
        if recorded:
            self._rewrite(tensors, recorded, shadow)
        if len(recorded) != len(stale):
            cleared = torch.tensor([slot for slot in stale if slot not in shadow], device=tensors[0].device)
            tensors[0][cleared] = 0
            tensors[1][cleared] = 0
        stale.clear()

    def _rewrite(
        self, tensors: tuple[torch.Tensor, torch.Tensor], slots: list[int], shadow: dict[int, SlotWrite]
    ) -> None:
        """The rows of ``slots`` (each recorded) set to their records' K/V."""
        keys, values = kv_for_tags([shadow[slot].tag for slot in slots], self.shape)
        index = torch.tensor(slots, device=tensors[0].device)
        tensors[0][index] = keys
        tensors[1][index] = values

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
        self._landed(slots)
        self.shadow.update(zip(slots, writes))
        if self.withdrawn:
            for slot in slots:
                self.withdrawn.pop(slot // self.block_size, None)
        if self._device is not None:
            self._stale.update(slots)
        self.dirty.update(slots)
        if self.observer is not None:
            by_block: dict[int, list[tuple[int, SlotWrite]]] = {}
            for slot, record in zip(slots, writes):
                by_block.setdefault(slot // self.block_size, []).append((slot % self.block_size, record))
            for block, changed in by_block.items():
                self.observer(PoolEvent("write", block, None, tuple(changed)))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: the whole of block ``src`` into block ``dst``, as part of the next step's work."""
        self._copy(self.shadow, src, self.shadow, dst, f"copied from block {src}", "copy")

    def swap_to_host(self, block: int, host_block: int, via: str = "") -> None:
        """Copy device block ``block`` into host block ``host_block`` (a swap-out, or a host-tier store)."""
        self._copy(
            self.shadow, block, self.host_shadow, host_block, via or f"swapped out from block {block}", "swap-out"
        )

    def swap_from_host(self, host_block: int, block: int, via: str = "", step: Optional[int] = None) -> None:
        """Copy host block ``host_block`` into device block ``block`` (a swap-in, or a host-tier load) as part of step
        ``step`` (default: the next step; an asynchronous load reported landed was part of a completed one)."""
        self._copy(
            self.host_shadow,
            host_block,
            self.shadow,
            block,
            via or f"swapped in from host block {host_block}",
            "swap-in",
            step=step,
        )

    def listed_free(self, block: int) -> None:
        """The allocator listed ``block`` free: whatever K/V it holds left the cache (:attr:`freed_tags`)."""
        for slot in range(block * self.block_size, (block + 1) * self.block_size):
            record = self.shadow.get(slot)
            if record is not None:
                self.freed_tags.setdefault(slot, set()).add(record.tag)

    def _landed(self, slots: Iterable[int]) -> None:
        """A write or copy landed in ``slots``: what they held when freed is gone (a hit on it now meets other K/V,
        which the content checks name)."""
        if self.freed_tags:
            for slot in slots:
                self.freed_tags.pop(slot, None)

    def taken_fresh(self, block: int, tags: Sequence[int]) -> None:
        """A table took ``block`` fresh (not by a hit) to hold ``tags`` from its first slot on: a hit on those is on
        writes scheduled anew, not on what the block held when freed."""
        if self.freed_tags:
            for slot, tag in zip(range(block * self.block_size, (block + 1) * self.block_size), tags):
                self.freed_tags.get(slot, set()).discard(tag)

    def _copy(
        self,
        src_shadow: dict[int, SlotWrite],
        src: int,
        dst_shadow: dict[int, SlotWrite],
        dst: int,
        via: str,
        kind: str,
        step: Optional[int] = None,
    ) -> None:
        """Block ``src``'s records into block ``dst`` (of the same pool or the other one: ``dst_shadow`` says which);
        the device pool's destination slots are marked written (dirty) for the checks."""
        size = self.block_size
        dst_slots = range(dst * size, (dst + 1) * size)
        to_device = dst_shadow is self.shadow
        if to_device:
            self.withdrawn.pop(dst, None)
            if self._device is not None:
                self._stale.update(dst_slots)
        elif self._host is not None:
            self._host_stale.update(dst_slots)
        if to_device:
            self._landed(dst_slots)
        for offset in range(size):
            record = src_shadow.get(src * size + offset)
            if record is None:
                dst_shadow.pop(dst * size + offset, None)
            else:
                dst_shadow[dst * size + offset] = attrs.evolve(
                    record, step=self.next_step if step is None else step, via=via
                )
        if to_device:
            self.dirty.update(dst_slots)
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
        if self._device is not None:
            self._stale.update(slots)
        self.dirty.update(slots)
        if self.observer is not None:
            self.observer(PoolEvent("land", work.block, None, tuple(landed)))

    # -- provenance ----------------------------------------------------------------------------------------------

    def note(self, block: int, event: str, *args: object) -> None:
        """Record an event in the block's short history, for explanations: ``event``, or with ``args``
        ``event.format(*args)``, made into text only when an explanation reads it (the arguments are strings and
        numbers, which nothing changes)."""
        events = self.history.get(block)
        if events is None:
            events = self.history[block] = deque(maxlen=_HISTORY_LENGTH)
        events.append((self.next_step, event, args))

    def block_story(self, block: int) -> list[str]:
        events = self.history.get(block)
        if not events:
            return [f"block {block} history: (no events recorded)"]
        return [f"block {block} history (latest last):"] + [
            f"  step {step}: {event.format(*args) if args else event}" for step, event, args in events
        ]

    def take_dirty(self) -> set[int]:
        dirty, self.dirty = self.dirty, set()
        return dirty

    def record(self, slot: int) -> Optional[SlotWrite]:
        return self.shadow.get(slot)

    def rows(self, slots: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The device pool's K and V rows of ``slots`` (the tensors made or brought up to date first)."""
        keys, values = self._device_tensors()
        index = torch.tensor(list(slots), device=keys.device)
        return keys[index], values[index]
