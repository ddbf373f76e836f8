"""What kvfuzz expects of the allocator's state: each sequence's lifecycle and block table, who references every
block, which sequences finished, and every live sequence's tokens (the contiguous reference).

``BlockRefs`` keeps, for every block, the set of (sequence, logical index) entries of running sequences that map
to it; the expected refcount of a block is the size of that set, and a block with no holders is unreferenced.
Dropped entries (NULL_BLOCK) reference nothing.
"""

from __future__ import annotations

import enum
import itertools
from typing import Iterable, Mapping, Optional, Protocol

import attrs

from kvfuzz.allocator.types import NULL_BLOCK, Capabilities, Namespace, SeqId, group_block_sizes
from kvfuzz.engine.groups import group_seq
from kvfuzz.engine.layout import TableLayout
from kvfuzz.engine.matchable import MatchablePrefixes
from kvfuzz.reference.content import prefix_tags
from kvfuzz.reference.contiguous import ContiguousReference

RETIRED_KEPT = 256
"""How many finished sequences' tokens the expected state keeps, to name what a stale slot was written for."""


def mapped(table: Iterable[int]) -> list[int]:
    """The physical blocks a table maps, in order, without its dropped (NULL_BLOCK) entries."""
    return [block for block in table if block != NULL_BLOCK]


def common_prefix(old: tuple[int, ...], new: tuple[int, ...]) -> int:
    """How many leading entries two tables share, where one extends the other (a grow, a rollback); 0 otherwise
    (entries past it are compared one by one)."""
    if new[: len(old)] == old:
        return len(old)
    if old[: len(new)] == new:
        return len(new)
    return 0


class Status(enum.Enum):
    RUNNING = "running"
    SWAPPED = "swapped out"
    PREEMPTED = "preempted"
    LOADING = "loading"  # admitted under async_loads, its loads not yet landed: holds its cache hit's blocks only
    LOADED = "loaded"  # its loads landed: waits for resume to allocate the rest of its prompt

    # Members are singletons compared by identity: hashing by identity agrees with that, and costs no Python call
    # (Enum's own hashes the name), which the census's and enablement's dictionaries keyed by status pay often.
    __hash__ = object.__hash__


STATUSES = tuple(Status)
"""Every status, in a tuple (iterating the enumeration itself costs more, and a census does it once per call)."""


def _notify(model: SeqModel, attribute: attrs.Attribute, value: object) -> object:  # type: ignore[type-arg]
    """Every assignment to a field of a :class:`SeqModel` in a state's ``seqs``: the state is told when the value
    changes (the single point where a sequence's model changes, whoever assigns it)."""
    state = model._state
    if state is not None and getattr(model, attribute.name) != value:
        state.seq_changed(model.seq)
    return value


@attrs.define(on_setattr=_notify)
class SeqModel:
    """One sequence the engine knows. Positions below ``written`` hold K/V; the rest are written at the next step.

    ``table`` is the device block table while running (NULL_BLOCK where a sliding window dropped a block);
    ``host_table`` the host blocks while swapped out. ``awaits_step`` marks a cache hit on K/V another sequence
    writes only at the next step (``hits_scheduled_writes``): until that step the sequence is not computed.
    ``joined_step`` is the step before which it last gained its blocks (admission, fork, swap-in): no step before
    that one has read them for it. ``drafts`` counts the unverified drafts at the end of its tokens that a rollback
    may still drop, when the allocator declares ``speculative_tokens``: those of its latest grow, less those dropped.
    """

    seq: SeqId
    status: Status
    table: tuple[int, ...] = ()
    host_table: tuple[int, ...] = ()
    written: int = 0
    awaits_step: bool = False
    joined_step: int = 0
    drafts: int = 0
    group: int = 0  # the KV-cache group whose table this is (0 without kv_groups)
    owner: SeqId = ""  # the sequence a group table belongs to ("" for a sequence itself)
    # The length at which a refused grow dropped blocks out of the next token's window (refusal_drops_window), -1
    # for none: while the sequence keeps that length, its window starts one position later (``len + 1 - w``).
    dropped_at_length: int = -1
    # While LOADING or LOADED: the tokens its table covers, its admission's cache hit (None: every token).
    covered_tokens: Optional[int] = None
    # The state whose ``seqs`` holds it (set and cleared by its :class:`SeqTable`), told of every change of a field.
    _state: Optional[ExpectedState] = attrs.field(
        default=None, init=False, eq=False, repr=False, on_setattr=attrs.setters.NO_OP
    )


class SeqTable(dict[SeqId, SeqModel]):
    """An expected state's ``seqs``: a dictionary that binds each model put in it to the state (so that its field
    assignments reach :meth:`ExpectedState.seq_changed`) and tells the state of every sequence added or removed.
    Only the mutations the engine makes are allowed (item assignment, ``setdefault``, ``del``); the others raise."""

    def __init__(self, state: ExpectedState) -> None:
        super().__init__()
        self._owner = state  # the state told of every change

    def __setitem__(self, seq: SeqId, model: SeqModel) -> None:
        previous = self.get(seq)
        if previous is not None and previous is not model:
            object.__setattr__(previous, "_state", None)  # past attrs' hook machinery: the binding is no field change
        object.__setattr__(model, "_state", self._owner)
        super().__setitem__(seq, model)
        self._owner.seq_added(seq, model)

    def setdefault(self, seq: SeqId, model: SeqModel) -> SeqModel:  # type: ignore[override]
        existing = self.get(seq)
        if existing is not None:
            return existing
        self[seq] = model
        return model

    def __delitem__(self, seq: SeqId) -> None:
        model = self[seq]
        super().__delitem__(seq)
        object.__setattr__(model, "_state", None)
        self._owner.seq_removed(seq)

    def _refused(self, *args: object, **kwargs: object) -> None:
        raise TypeError("an expected state's seqs change only by assignment, setdefault or del")

    pop = popitem = clear = update = __ior__ = _refused  # type: ignore[assignment]


@attrs.frozen
class TableChange:
    """What one table update did to the blocks: every block whose holders changed, and which became (un)referenced."""

    touched: frozenset[int]
    released: tuple[int, ...]
    acquired: tuple[int, ...]


class BlockRefs:
    """Holders of every referenced block. Invariant kept: a block is a key of ``holders`` exactly while some running
    sequence's table maps it, and its set lists every (sequence, logical index) entry that does; a block is a key of
    ``released`` exactly while some table mapped it once and none maps it now; ``version`` changes whenever
    ``released`` does (only :meth:`replace` changes either)."""

    def __init__(self) -> None:
        self.holders: dict[int, set[tuple[SeqId, int]]] = {}  # block -> the table entries that reference it
        self.released: dict[int, None] = {}  # blocks once mapped and now unreferenced, in the order they were released
        self.version = 0  # bumped by every update that may change ``released``

    def refcount(self, block: int) -> int:
        return len(self.holders.get(block, ()))

    def num_referenced(self) -> int:
        return len(self.holders)

    def num_ever_mapped(self) -> int:
        """Blocks some table has mapped so far (referenced now or released)."""
        return len(self.holders) + len(self.released)

    def replace(self, seq: SeqId, old: tuple[int, ...], new: tuple[int, ...]) -> TableChange:
        """``seq``'s table went from ``old`` to ``new``."""
        touched, released, acquired = set(), [], []
        for index in range(common_prefix(old, new), max(len(old), len(new))):
            before = old[index] if index < len(old) and old[index] != NULL_BLOCK else None
            after = new[index] if index < len(new) and new[index] != NULL_BLOCK else None
            if before == after:
                continue
            if before is not None:
                holders = self.holders[before]
                holders.discard((seq, index))
                touched.add(before)
                if not holders:
                    del self.holders[before]
                    released.append(before)
            if after is not None:
                holders = self.holders.setdefault(after, set())
                if not holders:
                    acquired.append(after)
                holders.add((seq, index))
                touched.add(after)
        released = [block for block in released if block not in self.holders]
        if released or acquired:
            self.version += 1
        for block in acquired:
            self.released.pop(block, None)
        for block in reversed(released):
            self.released[block] = None
        return TableChange(frozenset(touched), tuple(reversed(released)), tuple(acquired))


@attrs.frozen
class Census:
    """The sequences (group tables aside), each list in the order of the state's ``seqs``, as enablement reads them:
    ``by_status`` every status's (what ``ids`` answers; every status a key), ``live`` every one not preempted (what
    ``live_ids`` answers), ``computed`` the running ones whose every token a step has written and that await no step
    (what ``computed_ids`` answers). Made by :meth:`ExpectedState.census` from its index of the sequences, and kept
    (the same object, its lists never changed) for as long as no sequence's entry in that index changes."""

    by_status: dict[Status, list[SeqId]]
    live: list[SeqId]
    computed: list[SeqId]


class LandableLoads(Protocol):
    """Under ``async_loads``, the feature that keeps the admissions' asynchronous loads
    (:class:`kvfuzz.engine.features.host_tier.AsyncLoading`): which of them may be reported landed now."""

    def landable_ids(self) -> list[SeqId]: ...


class ProgramState(Protocol):
    """The queries the operation table and misuse calls make of the engine's state: :class:`ExpectedState`
    implements them, and so does the benchmark's bare machine, which keeps the bookkeeping alone."""

    caps: Capabilities
    block_size: int
    num_host_blocks: int
    finished: list[SeqId]

    def new_id(self) -> SeqId: ...

    def is_fresh(self, seq: SeqId) -> bool: ...

    def ids(self, status: Status) -> list[SeqId]: ...

    def live_ids(self) -> list[SeqId]: ...

    def computed_ids(self) -> list[SeqId]: ...

    def preemptible_ids(self) -> list[SeqId]: ...

    def freeable_ids(self) -> list[SeqId]: ...

    def rollbackable_ids(self) -> list[SeqId]: ...

    def rollback_limit(self, seq: SeqId) -> int: ...

    def length(self, seq: SeqId) -> int: ...

    def released_blocks(self) -> list[int]: ...

    def landable_ids(self) -> list[SeqId]: ...


class SequenceLists(ProgramState, Protocol):
    """A program state whose models can be read: what :class:`DerivedIds` makes its lists from (the status lists,
    the rollback limits, and for ``freeable_ids`` each model's status)."""

    @property
    def seqs(self) -> Mapping[SeqId, SeqModel]: ...


class DerivedIds:
    """The sequences an operation may pick, made from the status lists (:class:`SequenceLists`): written once here
    and read two ways, by the expected state from its own passes over the sequences, and by a census snapshot
    (:class:`kvfuzz.engine.arguments.CensusSnapshot`) from its census, which answers the same lists."""

    def preemptible_ids(self: SequenceLists) -> list[SeqId]:
        """Running sequences the engine may preempt: any, or only computed ones when the allocator declares that
        its engine never withdraws scheduled work (``preempt_scheduled=False``)."""
        return self.ids(Status.RUNNING) if self.caps.preempt_scheduled else self.computed_ids()

    def freeable_ids(self: SequenceLists) -> list[SeqId]:
        """Live sequences the engine may free: any, or none with scheduled, uncomputed tokens when the allocator
        declares that its engine has no abort (``free_scheduled=False``)."""
        if self.caps.free_scheduled:
            return self.live_ids()
        computed = set(self.computed_ids())
        seqs = self.seqs
        return [seq for seq in self.live_ids() if seqs[seq].status is not Status.RUNNING or seq in computed]

    def rollbackable_ids(self: SequenceLists) -> list[SeqId]:
        """Running sequences that can drop at least one token (:meth:`ExpectedState.rollback_limit`)."""
        limit = self.rollback_limit
        return [seq for seq in self.ids(Status.RUNNING) if limit(seq) >= 1]


class ExpectedState(DerivedIds):
    """The engine's expectation of one allocator, kept by the engine and read by the checks and the operation table.

    Invariant kept: every sequence in ``seqs`` has its tokens in ``reference``; ``refs`` holds exactly the entries of
    the running sequences' tables; a finished sequence is in ``finished`` and nowhere else.

    What enablement reads changes at one point: a sequence added to or removed from ``seqs`` (a :class:`SeqTable`),
    a field of one of its models assigned a new value (:class:`SeqModel`'s hook), its tokens changed in the
    reference (``on_change``), all three reaching :meth:`seq_changed`; ``refs.released`` changes with
    ``refs.version``, ``finished`` only grows, and the asynchronous loads call :meth:`changed`. :meth:`stamp`
    combines them: two equal stamps mean nothing enablement reads has changed in between. The index of the
    sequences (each one's status and whether it is computed, in the order of ``seqs``) is kept from the same
    notifications: a sequence is re-examined when it was notified since the last :meth:`census`, never otherwise.
    """

    def __init__(
        self, caps: Capabilities, block_size: int, num_blocks: int, num_host_blocks: int, reference: ContiguousReference
    ) -> None:
        self.caps = caps  # what the allocator declares
        self.block_size = block_size  # tokens per block of the pool (of a group that declares no size of its own)
        sizes = group_block_sizes(caps.kv_groups, block_size) if caps.kv_groups else (block_size,)
        self.rows = max(sizes)  # rows (slots) every physical block has in the K/V pools
        # Per KV-cache group (one without groups): where its tables' positions live in the pools.
        self.layouts = tuple(TableLayout(size, self.rows) for size in sizes)
        self.num_blocks = num_blocks  # device blocks in the pool
        self.num_host_blocks = num_host_blocks  # host blocks, 0 unless the allocator declares swap
        self.reference = reference  # every live sequence's namespace and tokens, and attention over them
        self.seqs: dict[SeqId, SeqModel] = SeqTable(self)  # live sequences: running, swapped out or preempted
        self.version = 0  # bumped at every change of a sequence (seq_changed) or an asynchronous load (changed)
        # The index the census reads: every sequence in seqs but group tables, in the order of seqs, with its status
        # and whether it is computed as of the last census (None: not examined yet); and the sequences notified
        # since, which the next census examines again.
        self._index: dict[SeqId, Optional[tuple[Status, bool]]] = {}
        self._notified: set[SeqId] = set()
        self._census: Optional[Census] = None  # the census of the index as it is, until an entry changes
        reference.on_change = self.seq_changed
        self.refs = BlockRefs()  # who references every device block
        self.finished: list[SeqId] = []  # freed sequences, oldest first; their ids are never used again
        # The namespace and tokens of the latest RETIRED_KEPT sequences gone from the reference (freed, or dismissed
        # while preempted), oldest first: their writes may still sit in cached blocks.
        self.retired: dict[SeqId, tuple[Namespace, tuple[int, ...]]] = {}
        # Blocks an eviction dropped from the cache and no table has mapped since, with the eviction that dropped
        # each: a cache hit on one of them is unsound, whatever K/V it still holds.
        self.evicted: dict[int, str] = {}
        self.matchable = MatchablePrefixes()  # under complete caching: the full blocks the cache owes matchable
        # Under host_cache, slot -> tag of the writes of sequences freed since the last launch, which that launch
        # still makes (after its flushed stores and loads land, as a worker orders them).
        self.aborted_tags: dict[int, int] = {}
        # Under async_loads: the feature keeping the loads not yet reported landed (None otherwise).
        self.async_loading: Optional[LandableLoads] = None
        self._ids = itertools.count()  # numbers of the ids new_id hands out

    def new_id(self) -> SeqId:
        """The next id no sequence has had: ids drawn are counted, and those a program's own calls named (a mutant
        keeps a seed's calls beside calls it draws afresh, :mod:`kvfuzz.program.mutants`) are passed over."""
        while True:
            seq = f"s{next(self._ids)}"
            if self.is_fresh(seq):
                return seq

    def retire(self, seq: SeqId) -> None:
        """``seq`` leaves the reference: keep its namespace and tokens (the latest RETIRED_KEPT only)."""
        self.retired[seq] = (self.reference.namespace(seq), tuple(self.reference.tokens(seq)))
        if len(self.retired) > RETIRED_KEPT:
            del self.retired[next(iter(self.retired))]

    def prefix_written(self, seq: SeqId, position: int, tag: int) -> Optional[tuple[Namespace, tuple[int, ...]]]:
        """The namespace and tokens up to ``position`` whose K/V has ``tag``, if ``seq`` (live or retired) still
        has that prefix; None when it is unknown (forgotten, or rolled back and regrown differently)."""
        if seq in self.reference:
            tags = self.reference.tags(seq)
            if position < len(tags) and tags[position] == tag:
                return self.reference.namespace(seq), tuple(self.reference.tokens(seq)[: position + 1])
            return None
        namespace, tokens = self.retired.get(seq, ((), ()))
        if position < len(tokens) and prefix_tags(namespace, tokens[: position + 1])[-1] == tag:
            return namespace, tokens[: position + 1]
        return None

    def is_fresh(self, seq: SeqId) -> bool:
        """No sequence has ever had this id."""
        return seq not in self.seqs and seq not in self.finished

    def ids(self, status: Status, groups: bool = False) -> list[SeqId]:
        """Sequences with ``status``, and with ``groups`` the group tables (other than group 0's) of those."""
        return [seq for seq, model in self.seqs.items() if model.status is status and (groups or not model.owner)]

    # -- the single mutation point: what enablement reads ----------------------------------------------------------

    def seq_changed(self, seq: SeqId) -> None:
        """``seq``'s model or tokens changed (or it was added or removed): its index entry is examined again."""
        self.version += 1
        self._notified.add(seq)

    def seq_added(self, seq: SeqId, model: SeqModel) -> None:
        """``seq`` was put in ``seqs`` (a group table is not indexed)."""
        if not model.owner and seq not in self._index:
            self._index[seq] = None
        self.seq_changed(seq)

    def seq_removed(self, seq: SeqId) -> None:
        """``seq`` left ``seqs``."""
        if self._index.pop(seq, 0) != 0:
            self._census = None
        self.seq_changed(seq)

    def changed(self) -> None:
        """Something enablement reads changed outside the sequences (the asynchronous loads)."""
        self.version += 1

    def stamp(self) -> tuple[int, int, int]:
        """Differs whenever anything enablement reads may have changed since it was taken (the sequences, their
        tokens, the released blocks, the finished list, the asynchronous loads)."""
        return self.version, self.refs.version, len(self.finished)

    def census(self) -> Census:
        """``ids`` of every status, ``live_ids`` and ``computed_ids`` (the same lists, in the same order:
        ``tests/test_operations.py`` and ``tests/test_enablement.py`` compare them over thousands of states), from
        the index: the sequences notified since the last census are examined again, and the lists made again only
        when one's entry changed."""
        notified, index = self._notified, self._index
        if notified:
            seqs = self.seqs
            for seq in notified:
                entry = index.get(seq, 0)
                if entry == 0:  # not indexed: a group table, or gone
                    continue
                model = seqs[seq]
                status = model.status
                now = (
                    status,
                    status is Status.RUNNING and model.written == self.length(seq) and not model.awaits_step,
                )
                if now != entry:
                    index[seq] = now
                    self._census = None
            notified.clear()
        census = self._census
        if census is None:
            by_status: dict[Status, list[SeqId]] = {status: [] for status in STATUSES}
            live, computed = [], []
            for seq, entry in index.items():
                status, is_computed = entry  # type: ignore[misc]  # every entry examined above
                by_status[status].append(seq)
                if status is not Status.PREEMPTED:
                    live.append(seq)
                    if is_computed:
                        computed.append(seq)
            census = self._census = Census(by_status, live, computed)
        return census

    def live_ids(self) -> list[SeqId]:
        """Sequences that hold blocks or a place in the host pool: everything but the preempted."""
        return [seq for seq, model in self.seqs.items() if model.status is not Status.PREEMPTED and not model.owner]

    def group_tables(self, seq: SeqId) -> list[SeqId]:
        """The ids of ``seq``'s tables in groups 1 onwards (none without ``kv_groups``)."""
        return [group_seq(seq, group.name) for group in self.caps.kv_groups[1:]]

    def label(self, seq: SeqId) -> str:
        """How reports name ``seq``: ``sequence s2``, or under ``kv_groups`` ``sequence s2, group sliding``."""
        model = self.seqs.get(seq)
        if not self.caps.kv_groups or model is None:
            return f"sequence {seq}"
        return f"sequence {model.owner or seq}, group {self.caps.kv_groups[model.group].name}"

    def entries(self, holders: Iterable[tuple[SeqId, int]]) -> str:
        """Block-table entries as reports list them: ``[('s1', 0), ('s2', 0)]``, or under ``kv_groups`` each with
        its group: ``sequence s1, group full logical block 0; ...``."""
        if not self.caps.kv_groups:
            return str(sorted(holders))
        return "; ".join(f"{self.label(seq)} logical block {index}" for seq, index in sorted(holders))

    def layout(self, seq: SeqId) -> TableLayout:
        """Where ``seq``'s table (a sequence's, or one group's) keeps its positions in the pools."""
        model = self.seqs.get(seq)
        return self.layouts[model.group if model is not None else 0]

    def window(self, seq: SeqId) -> Optional[int]:
        """The sliding window of ``seq``'s table: its group's under ``kv_groups``, else ``sliding_window``."""
        if self.caps.kv_groups:
            return self.caps.kv_groups[self.seqs[seq].group].sliding_window
        return self.caps.sliding_window

    def computed_ids(self) -> list[SeqId]:
        """Running sequences whose every token has been written by a step."""
        return [
            seq
            for seq, model in self.seqs.items()
            if model.status is Status.RUNNING
            and not model.owner
            and model.written == self.length(seq)
            and not model.awaits_step
        ]

    def length(self, seq: SeqId) -> int:
        return len(self.reference.tokens(seq))

    def released_blocks(self) -> list[int]:
        """Blocks some table once mapped and none maps now, oldest release first: what targeted eviction picks from
        (the cached ones among them, and free ones it must leave alone)."""
        return list(self.refs.released)

    def landable_ids(self) -> list[SeqId]:
        """Sequences (live, or freed while loading) whose asynchronous loads may be reported landed now."""
        return [] if self.async_loading is None else self.async_loading.landable_ids()

    def host_blocks_in_use(self) -> int:
        """Distinct host blocks some swapped-out sequence holds (one block may have several holders under
        ``shares_host_blocks``)."""
        return len(self.host_holders())

    def host_holders(self) -> dict[int, list[tuple[SeqId, int]]]:
        """Host block -> every (swapped-out sequence, logical index) holding it: one, or several under
        ``shares_host_blocks``."""
        holders: dict[int, list[tuple[SeqId, int]]] = {}
        for seq, model in self.seqs.items():
            for index, block in enumerate(model.host_table):
                if block != NULL_BLOCK:
                    holders.setdefault(block, []).append((seq, index))
        return holders

    def sliding_window_start(self, seq: SeqId) -> int:
        """The first position attention reads: 0, or ``len - w`` under a sliding window of w (``len + 1 - w``, the
        next token's window, once a refused grow dropped blocks out of it at this length)."""
        sliding_window = self.window(seq)
        if sliding_window is None:
            return 0
        length, model = self.length(seq), self.seqs.get(seq)
        return max(0, length - sliding_window + (model is not None and model.dropped_at_length == length))

    def rollback_limit(self, seq: SeqId) -> int:
        """The most tokens ``seq`` can drop: one must stay, no dropped block may come back into the window, and under
        ``speculative_tokens`` only the drafts of its latest grow may go."""
        limit = self.length(seq) - 1
        if self.caps.speculative_tokens is not None:
            limit = min(limit, self.seqs[seq].drafts)
        sliding_window = self.window(seq)
        if sliding_window is None:
            return limit
        table = self.seqs[seq].table
        if NULL_BLOCK in table:
            first_kept = self.layout(seq).first_position(len(table) - table[::-1].index(NULL_BLOCK))
            limit = min(limit, self.length(seq) - sliding_window - first_kept)
        return limit

    def num_blocks_for(self, seq: SeqId) -> int:
        """How many blocks ``seq``'s tokens fill: its table holds these, then at most ``lookahead_blocks`` more (a
        loading or loaded sequence's table covers its cache hit alone)."""
        model = self.seqs.get(seq)
        covered = model.covered_tokens if model is not None else None
        return self.layout(seq).blocks_for(self.length(seq) if covered is None else covered)

    def scheduled_writes(self, seq: SeqId) -> list[tuple[int, int]]:
        """(position, slot) of every token of ``seq`` the next step writes."""
        model, layout = self.seqs[seq], self.layout(seq)
        return [
            (position, layout.slot_of(model.table, position))
            for position in range(model.written, self.length(seq))
            if model.table[layout.index(position)] != NULL_BLOCK
        ]

    def scheduled_writer(self, slot: int) -> Optional[tuple[SeqId, int]]:
        """The running sequence and position the next step writes into ``slot``, if any (scans every schedule:
        for explanations only)."""
        for seq in self.ids(Status.RUNNING, groups=True):
            for position, scheduled in self.scheduled_writes(seq):
                if scheduled == slot:
                    return seq, position
        return None

    def scheduled_tags(self) -> dict[int, int]:
        """Slot -> tag of every write the next step makes (the first running sequence's, should two write one slot;
        then those of sequences freed since the last launch, under ``host_cache``)."""
        scheduled: dict[int, int] = {}
        for seq in self.ids(Status.RUNNING, groups=True):
            tags = self.reference.tags(seq)
            for position, slot in self.scheduled_writes(seq):
                scheduled.setdefault(slot, tags[position])
        for slot, tag in self.aborted_tags.items():
            scheduled.setdefault(slot, tag)
        return scheduled
