"""The engine's lifecycle events, and who listens to them.

The engine core calls the allocator, performs what it orders and updates the expected state; at a few points of that
lifecycle it fires an event, and the checks and the declared features (:mod:`kvfuzz.engine.features`) that subscribed
run, in the order they subscribed, as Hypothesis runs its ``@invariant`` s after every step. A feature subscribes
only when the allocator declares it, so an allocator that declares nothing pays for no handler.
"""

from __future__ import annotations

from typing import AbstractSet, Callable, Optional

import attrs

from kvfuzz.allocator.types import SeqId
from kvfuzz.engine.expected import TableChange
from kvfuzz.engine.pools import SlotWrite


@attrs.frozen
class TableSet:
    """One table the engine just recorded: ``seq``'s table went from ``old`` to ``table``, ``change`` to the blocks;
    ``hit_tokens`` of it an admission's cache hit; ``held_tokens`` how many tokens the old table held (None: its
    length now)."""

    seq: SeqId
    old: tuple[int, ...]
    table: tuple[int, ...]
    change: TableChange
    hit_tokens: int
    held_tokens: Optional[int]


@attrs.define
class Launch:
    """A step being launched: the writes it makes, in order (slots and their writes, index for index). Invariant
    kept: the two lists have one entry per write; a subscriber may put writes before the others."""

    step: int
    slots: list[int]
    writes: list[SlotWrite]


@attrs.frozen
class Completion:
    """A step that just completed, and the blocks its completion may have settled (their window closed, or held
    pending by the allocator before it), in the order the engine gathered them (which block a violation names)."""

    step: int
    settled: AbstractSet[int]


class EngineEvents:
    """Subscribers of each lifecycle event, in the order they run (registration order)."""

    def __init__(self) -> None:
        # A table was recorded (after its blocks' histories and the pools' releases).
        self.table_set: list[Callable[[TableSet], None]] = []
        # An operation's table updates are done and their content checked: the blocks they touched.
        self.table_changed: list[Callable[[TableChange], None]] = []
        # A sequence is about to release its table (free, preempt): what still writes its blocks must hold them.
        self.releasing: list[Callable[[SeqId], None]] = []
        # A step is being scheduled, before the writes of its running sequences are gathered.
        self.scheduling: list[Callable[[int], None]] = []
        # A step's writes are gathered; it is launched (and they are made) once every subscriber has run.
        self.launching: list[Callable[[Launch], None]] = []
        # A step is launched and its writes made: what they wrote, and what attention reads, is checked.
        self.launched: list[Callable[[int], None]] = []
        # An operation is about to begin (one call may make several: a decode grows every sequence, then steps), or
        # steps are about to complete within one: what came before is done (a replay's audit looks there, so that a
        # wrong change is told apart from what follows it in the same call).
        self.boundary: list[Callable[[], None]] = []
        # A step is completing, before the allocator hears of it.
        self.completing: list[Callable[[int], None]] = []
        # A step has completed and the allocator has heard of it.
        self.completed: list[Callable[[Completion], None]] = []
        # Every sequence is gone and the in-flight work done.
        self.quiesced: list[Callable[[], None]] = []

    def fire_table_set(
        self,
        seq: SeqId,
        old: tuple[int, ...],
        table: tuple[int, ...],
        change: TableChange,
        hit_tokens: int,
        held_tokens: Optional[int],
    ) -> None:
        if self.table_set:
            record = TableSet(seq, old, table, change, hit_tokens, held_tokens)
            for handler in self.table_set:
                handler(record)

    def fire_table_changed(self, change: TableChange) -> None:
        for handler in self.table_changed:
            handler(change)

    def fire_releasing(self, seq: SeqId) -> None:
        for handler in self.releasing:
            handler(seq)

    def fire_scheduling(self, step: int) -> None:
        for handler in self.scheduling:
            handler(step)

    def fire_launching(self, launch: Launch) -> None:
        for handler in self.launching:
            handler(launch)

    def fire_launched(self, step: int) -> None:
        for handler in self.launched:
            handler(step)

    def fire_boundary(self) -> None:
        for handler in self.boundary:
            handler()

    def fire_completing(self, step: int) -> None:
        for handler in self.completing:
            handler(step)

    def fire_completed(self, completion: Completion) -> None:
        for handler in self.completed:
            handler(completion)

    def fire_quiesced(self) -> None:
        for handler in self.quiesced:
            handler()
