"""Replaying a trace through kvfuzz's engine and recording what happened to every block, call by call.

The engine is the one every run uses (:class:`~kvfuzz.program.execution.Target`); the recorder only watches: the
K/V pools tell it of every write, copy and landing (:attr:`~kvfuzz.engine.pools.KVPools.observer`), and after each
call it compares the expected state (every sequence's block table, the in-flight window's pending blocks) and, when
the allocator declares introspection, its refcounts and cached set, with what they were before the call.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections import deque
from typing import Any, Callable, Iterable, Optional

import attrs

from kvfuzz.allocator.protocol import NamesLibraryBlocks
from kvfuzz.allocator.types import NULL_BLOCK
from kvfuzz.engine.engine import Engine
from kvfuzz.engine.pools import PoolEvent, SlotWrite
from kvfuzz.engine.violations import InvariantViolation
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Execution, Safeguards, Target
from kvfuzz.program.safeguards import DEFAULT_CALL_TIMEOUT, AllocatorHang, Watchdog
from kvfuzz.registry import AllocatorNotFound, AllocatorTrust, UntrustedAllocator, load_factory
from kvfuzz.saved.corpus import PROCESS_DIED, reproduces_recorded
from kvfuzz.saved.trace import Trace
from kvfuzz.threads import single_threaded_torch
from kvfuzz.timeline.model import (
    DEVICE,
    EMPTY,
    HOST,
    Cell,
    Column,
    Holding,
    Lane,
    Mark,
    Outcome,
    SeqTable,
    Timeline,
)

MAX_COLUMNS = 10_000
"""The most calls one timeline shows: a longer trace shows the window of its last calls, up to the failure."""
ALL_LANES_UP_TO = 16
"""A trace touching at most this many blocks shows them all; a larger one only those of the failure."""

LaneKey = tuple[str, int]
_BLOCK = re.compile(r"(?<!logical )(host )?block(?:\(s\)|s)? \[?(\d+(?:, \d+)*)\]?")


@attrs.frozen
class _CallRecord:
    """One call's column, its marks, and the state after it of every lane it changed."""

    column: Column
    marks: tuple[tuple[LaneKey, str, str, Optional[LaneKey]], ...]  # (lane, kind, text, partner)
    changed: tuple[tuple[LaneKey, Cell], ...]


class _Recorder:
    """Watches one engine while a program runs, keeping the last ``max_columns`` calls' records."""

    def __init__(self, engine: Engine, max_columns: int) -> None:
        self.engine = engine  # the engine being watched
        self.records: deque[_CallRecord] = deque()  # the window of calls kept, oldest first
        self.max_columns = max_columns  # the most calls kept
        self.base: dict[LaneKey, Cell] = {}  # each lane's state before the first call kept
        self.state: dict[LaneKey, Cell] = {}  # each lane's state now
        self.touched: set[LaneKey] = set()  # every lane any kept call changed or marked
        self.events: list[PoolEvent] = []  # the pools' events of the call running
        self.introspection = engine.checks.introspection  # the allocator's queries, when it declares them
        engine.pools.observer = self.events.append
        self._known: dict[str, SeqTable] = {}  # every live sequence's table after the last call
        self._cached_now = self._cached()  # the allocator's cached set after the last call

    def _tables(self) -> dict[str, SeqTable]:
        """Every live sequence's table now; a sequence whose table did not change keeps its record."""
        expected = self.engine.expected
        tables = {}
        for seq, model in expected.seqs.items():
            length = len(expected.reference.tokens(seq)) if seq in expected.reference else 0
            known = self._known.get(seq)
            if (
                known is None
                or known.table is not model.table
                or known.host_table is not model.host_table
                or (known.written, known.length, known.status) != (model.written, length, model.status.value)
            ):
                known = SeqTable(seq, model.status.value, model.table, model.host_table, length, model.written)
            tables[seq] = known
        self._known = tables
        return tables

    def _cached(self) -> frozenset[int]:
        return frozenset(self.introspection.cached_blocks()) if self.introspection is not None else frozenset()

    def run(self, call_index: int, call: Optional[Call], perform: Callable[[], None]) -> Optional[BaseException]:
        """Perform one call (``call`` None: the teardown), record it, and return what it raised."""
        engine = self.engine
        tables_before = self._known
        pending_before = set(engine.pools.late_work_by_block)
        cached_before = self._cached_now
        self.events.clear()
        failure: Optional[BaseException] = None
        try:
            perform()
        except (Exception, AllocatorHang) as error:  # noqa: BLE001 -- the failure is what the timeline shows
            failure = error
        rule = call.rule if call is not None else "teardown"
        marks: list[tuple[LaneKey, str, str, Optional[LaneKey]]] = []
        tables_after = self._tables()
        with contextlib.suppress(Exception):  # a broken allocator's queries may raise: the timeline goes on
            self._cached_now = self._cached()
        with contextlib.suppress(Exception):
            self._holder_marks(rule, tables_before, tables_after, marks)
            self._pool_marks(rule, marks)
            self._window_marks(f"step {engine.pools.next_step} being scheduled", pending_before, marks)
            self._cache_marks(rule, call, cached_before, tables_after, marks)
            self._scheduled_marks(call, tables_after, marks)
        changed = {lane for lane, *_ in marks}
        changed |= self._changed_holders(tables_before, tables_after)
        cells = tuple((lane, self._cell(lane, tables_after)) for lane in sorted(changed))
        self.state.update(cells)
        column = Column(
            call_index,
            str(call) if call is not None else "teardown (quiesce)",
            rule,
            engine.pools.next_step,
            tuple(tables_after.values()),
        )
        self.records.append(_CallRecord(column, tuple(marks), cells))
        if len(self.records) > self.max_columns:
            self.base.update(self.records.popleft().changed)
        return failure

    # -- what changed ----------------------------------------------------------------------------------------------

    def _changed_holders(self, before: dict[str, SeqTable], after: dict[str, SeqTable]) -> set[LaneKey]:
        lanes: set[LaneKey] = set()
        for seq in set(before) | set(after):
            old, new = before.get(seq), after.get(seq)
            if old is new:
                continue
            for table in (old, new):
                if table is not None:
                    lanes |= {(DEVICE, block) for block in table.table if block != NULL_BLOCK}
                    lanes |= {(HOST, block) for block in table.host_table if block != NULL_BLOCK}
        return lanes

    def _holder_marks(
        self,
        rule: str,
        before: dict[str, SeqTable],
        after: dict[str, SeqTable],
        marks: list[tuple[LaneKey, str, str, Optional[LaneKey]]],
    ) -> None:
        how = {"admit": "admitted", "readmit": "readmitted", "grow": "grown", "fork": "forked, sharing"}
        for seq in list(before) + [seq for seq in after if seq not in before]:
            old, new = before.get(seq), after.get(seq)
            if old is new:
                continue
            for pool, old_blocks, new_blocks in (
                (DEVICE, old.table if old else (), new.table if new else ()),
                (HOST, old.host_table if old else (), new.host_table if new else ()),
            ):
                for index in range(max(len(old_blocks), len(new_blocks))):
                    was = old_blocks[index] if index < len(old_blocks) else NULL_BLOCK
                    now = new_blocks[index] if index < len(new_blocks) else NULL_BLOCK
                    if was == now:
                        continue
                    if was != NULL_BLOCK:
                        marks.append(
                            ((pool, was), "release", f"{seq} lets go of it (logical block {index}, {rule})", None)
                        )
                    if now != NULL_BLOCK:
                        verb = how.get(rule, rule)
                        marks.append(((pool, now), "hold", f"{seq} takes it as logical block {index} ({verb})", None))

    def _pool_marks(self, rule: str, marks: list[tuple[LaneKey, str, str, Optional[LaneKey]]]) -> None:
        for event in self.events:
            positions = _positions(event.writes)
            if event.kind == "write":
                marks.append(((DEVICE, event.block), "write", f"step writes {positions}", None))
            elif event.kind == "copy":
                kind = "fork-copy" if rule == "fork" else "cow"
                what = "fork copy" if rule == "fork" else "copy-on-write"
                assert event.source is not None
                text = f"{what} from block {event.source}: now holds {positions or 'nothing written'}"
                marks.append(((DEVICE, event.block), kind, text, (DEVICE, event.source)))
            elif event.kind == "swap-out":
                assert event.source is not None
                text = f"swap-out of block {event.source}: holds {positions or 'nothing written'}"
                marks.append(((HOST, event.block), "swap-out", text, (DEVICE, event.source)))
            elif event.kind == "swap-in":
                assert event.source is not None
                text = f"swap-in from host block {event.source}: holds {positions or 'nothing written'}"
                marks.append(((DEVICE, event.block), "swap-in", text, (HOST, event.source)))
            elif event.kind == "land":
                holders = self.engine.expected.refs.holders.get(event.block)
                over = f", over the K/V of {', '.join(sorted(f'{s}/{i}' for s, i in holders))}" if holders else ""
                text = f"late in-flight work landed: {positions}{over}"
                marks.append(((DEVICE, event.block), "land", text, None))

    def _window_marks(
        self, step: str, pending_before: set[int], marks: list[tuple[LaneKey, str, str, Optional[LaneKey]]]
    ) -> None:
        late = self.engine.pools.late_work_by_block
        for block in sorted(set(late) - pending_before):
            work = late[block]
            text = (
                f"released by {work.released_by} with work in flight ({step}): it may land until step "
                f"{work.lands_at} completes"
            )
            marks.append(((DEVICE, block), "pending", text, None))
        for block in sorted(pending_before - set(late)):
            marks.append(((DEVICE, block), "window-closed", "in-flight window closed", None))

    def _cache_marks(
        self,
        rule: str,
        call: Optional[Call],
        cached_before: frozenset[int],
        tables: dict[str, SeqTable],
        marks: list[tuple[LaneKey, str, str, Optional[LaneKey]]],
    ) -> None:
        cached = self._cached_now
        for block in sorted(cached - cached_before):
            marks.append(((DEVICE, block), "cached", "enters the allocator's cached set", None))
        for block in sorted(cached_before - cached):
            if rule in ("evict", "reset_cache", "teardown"):
                marks.append(((DEVICE, block), "evicted", f"dropped from the cache ({rule})", None))
        if call is None or rule not in ("admit", "readmit"):
            return
        seq = call.kwargs().get("seq")
        table = tables.get(seq) if isinstance(seq, str) else None
        if table is None or not table.written:
            return
        size = self.engine.expected.layout(str(seq)).size
        for index in range(-(-table.written // size)):
            block = table.table[index] if index < len(table.table) else NULL_BLOCK
            if block == NULL_BLOCK:
                continue
            last = min((index + 1) * size, table.written) - 1
            text = (
                f"cache hit: {seq} admitted with {table.written} cached tokens; positions {index * size}-{last} are "
                f"read from here ({self._written_by(block, last - index * size + 1)})"
            )
            marks.append(((DEVICE, block), "hit", text, None))

    def _written_by(self, block: int, count: int) -> str:
        """Who wrote the first ``count`` slots of ``block``, and whether those steps have completed."""
        pools = self.engine.pools
        records = [pools.record(block * self.engine.expected.rows + offset) for offset in range(count)]
        if not any(records):
            return "no write has put K/V here yet"
        steps = sorted({record.step for record in records if record is not None})
        done = (
            "completed"
            if steps[-1] <= pools.last_completed
            else f"not completed: last completed {pools.last_completed}"
        )
        missing = sum(record is None for record in records)
        return f"written by step {', '.join(map(str, steps))} ({done})" + (
            f"; {missing} slot(s) never written" if missing else ""
        )

    def _scheduled_marks(
        self,
        call: Optional[Call],
        tables: dict[str, SeqTable],
        marks: list[tuple[LaneKey, str, str, Optional[LaneKey]]],
    ) -> None:
        if call is None or call.rule not in ("admit", "readmit", "grow", "fork", "swap_in"):
            return
        arguments = call.kwargs()
        seq = arguments.get("child") if call.rule == "fork" else arguments.get("seq")
        table = tables.get(seq) if isinstance(seq, str) else None
        if table is None or table.status != "running":
            return
        size = self.engine.expected.layout(str(seq)).size
        by_block: dict[int, list[int]] = {}
        for position in range(table.written, table.length):
            index = position // size
            if index < len(table.table) and table.table[index] != NULL_BLOCK:
                by_block.setdefault(table.table[index], []).append(position)
        for block, positions in by_block.items():
            text = f"the next step writes {seq} positions {_span(positions)} here"
            marks.append(((DEVICE, block), "scheduled", text, None))

    def _cell(self, lane: LaneKey, tables: dict[str, SeqTable]) -> Cell:
        pool, block = lane
        if pool == HOST:
            holders = tuple(
                Holding(table.seq, index)
                for table in tables.values()
                for index, host_block in enumerate(table.host_table)
                if host_block == block
            )
            return Cell(tuple(sorted(holders, key=_holding_key)))
        engine = self.engine
        holders = tuple(
            sorted(
                (Holding(seq, index) for seq, index in engine.expected.refs.holders.get(block, ())), key=_holding_key
            )
        )
        refcount = None
        introspection = self.introspection
        if introspection is not None:
            with contextlib.suppress(Exception):
                refcount = int(introspection.refcount(block))
        cached = introspection is not None and block in self._cached_now
        return Cell(holders, refcount, block in engine.pools.late_work_by_block, cached)


def _holding_key(holding: Holding) -> tuple[int, str, int]:
    number = holding.seq[1:]
    return (int(number) if number.isdigit() else 1 << 30, holding.seq, holding.index)


def _span(positions: list[int]) -> str:
    return str(positions[0]) if len(positions) == 1 else f"{positions[0]}-{positions[-1]}"


def _positions(writes: Iterable[tuple[int, SlotWrite]]) -> str:
    """The K/V a block's changed slots hold, for a person: whose positions, from which namespace."""
    by_seq: dict[tuple[str, Any], list[int]] = {}
    for _, record in writes:
        by_seq.setdefault((record.seq, record.namespace), []).append(record.position)
    parts = []
    for (seq, namespace), positions in by_seq.items():
        where = f" (namespace {list(namespace)})" if namespace else ""
        parts.append(f"{seq} positions {_span(sorted(positions))}{where}")
    return "; ".join(parts)


def failure_blocks(explanation: str) -> set[LaneKey]:
    """The physical blocks an explanation names ("block 3", "host block 1", "block(s) [4, 5]"), not logical ones."""
    lanes: set[LaneKey] = set()
    for match in _BLOCK.finditer(explanation):
        pool = HOST if match.group(1) else DEVICE
        lanes |= {(pool, int(number)) for number in match.group(2).split(", ")}
    return lanes


def _describe(failure: BaseException) -> str:
    if isinstance(failure, InvariantViolation):
        return failure.explain()
    return f"{type(failure).__name__}: {failure}"


def record(
    trace: Trace,
    source: str,
    allocator: Optional[str] = None,
    max_columns: Optional[int] = None,
    call_timeout: Optional[float] = DEFAULT_CALL_TIMEOUT,
    trust: AllocatorTrust = AllocatorTrust(),
) -> Timeline:
    """Replay ``trace`` against its allocator (or ``allocator``) and record its timeline. An allocator that cannot
    be loaded here, or that the trace names and ``trust`` does not cover (nothing is imported then), gives a
    timeline of the program and the recorded failure alone, with a note saying why; a trace of a process the
    allocator killed is replayed up to the call that killed it."""
    spec = allocator or trace.allocator
    max_columns = MAX_COLUMNS if max_columns is None else max_columns
    program = list(trace.program)
    notes: list[str] = []
    recorded = str(trace.failure.get("explanation") or trace.failure.get("title") or "")
    title = str(trace.failure.get("title"))
    try:
        if allocator is None:
            trust.check(spec)
    except UntrustedAllocator as error:
        notes.append(
            f"not replayed: {error} (--trust-allocator replays it, if you trust where the trace came from; "
            "--allocator SPEC replays against an allocator you name)"
        )
        return _unreplayed(trace, source, spec, program, recorded, notes, max_columns)
    try:
        factory = load_factory(spec)
    except AllocatorNotFound as error:
        notes.append(
            f"not replayed: cannot load the allocator {spec} here ({error}); the block lanes need a replay: run "
            f"kvfuzz show where its library is installed"
        )
        return _unreplayed(trace, source, spec, program, recorded, notes, max_columns)
    died = title.startswith(PROCESS_DIED)
    if died:
        notes.append("the recorded failure killed the process: replayed up to the call that killed it, not that call")
    watch = Watchdog(call_timeout) if call_timeout is not None else contextlib.nullcontext()
    with single_threaded_torch(), watch as watchdog:
        execution = Target(factory, trace.config, safeguards=Safeguards(watchdog=watchdog)).start()
        recorder = _Recorder(execution.engine, max_columns)
        failure, failed_call = _run(execution, recorder, program[:-1] if died and program else program)
    if len(program) > max_columns and recorder.records:
        kept = recorder.records[0].column.call_index
        notes.append(
            f"the trace has {len(program)} calls, more than the {max_columns} a timeline shows: showing calls "
            f"{kept + 1}-{recorder.records[-1].column.call_index + 1}, the window that ends at the failure"
        )
    if died:
        verdict, explanation, failed_at = "not replayed", recorded, len(program) - 1
    elif failure is None:
        verdict, explanation, failed_at = "no longer reproduces", recorded, None
        notes.append(f"the replay against {spec} did not fail: the page shows the recorded failure's text")
    else:
        verdict = "reproduced" if reproduces_recorded(trace, failure) else "failed differently"
        explanation, failed_at = _describe(failure), failed_call
        if not isinstance(failure, InvariantViolation) and recorded and recorded not in explanation:
            explanation += f"\n\nrecorded when the trace was saved:\n{recorded}"
        if isinstance(failure, _NotApplicableHere):
            verdict, explanation = "not replayed", recorded
            notes.append(f"the replay stopped: {failure}; the program does not fit {spec}")
        elif verdict == "failed differently":
            notes.append(f"the replay failed differently from the recorded failure ({title})")
    return _timeline(trace, source, spec, recorder, failed_at, verdict, explanation, notes, program)


def _run(
    execution: Execution, recorder: _Recorder, program: list[Call]
) -> tuple[Optional[BaseException], Optional[int]]:
    """Run the program, then the teardown, stopping at the first failure; returns it and its call's index."""
    try:
        for index, call in enumerate(program):
            if not execution.accepts(call):
                return _NotApplicableHere(f"call {index + 1}, {call}, cannot be made in the state before it"), index
            failure = recorder.run(index, call, functools.partial(execution.execute, call.rule, call.kwargs()))
            if failure is not None:
                return failure, index
        failure = recorder.run(len(program), None, execution.teardown)
        if failure is None:
            recorder.records.pop()  # a teardown that found nothing is no part of the story
        return failure, (len(program) if failure is not None else None)
    finally:
        execution.engine.close()


class _NotApplicableHere(Exception):
    """A call of the trace that the allocator replayed here cannot take (the program does not fit it)."""


def _timeline(
    trace: Trace,
    source: str,
    spec: str,
    recorder: _Recorder,
    failed_at: Optional[int],
    verdict: str,
    explanation: str,
    notes: list[str],
    program: list[Call],
) -> Timeline:
    records = list(recorder.records)
    columns = [record.column for record in records]
    if failed_at is not None and (not columns or columns[-1].call_index < failed_at):
        call = program[failed_at] if failed_at < len(program) else None
        columns.append(
            Column(failed_at, str(call) if call else "teardown (quiesce)", call.rule if call else "teardown", -1, ())
        )
        records.append(_CallRecord(columns[-1], (), ()))
    failing_column = len(columns) - 1 if failed_at is not None else None
    touched: dict[LaneKey, int] = {}
    for record_ in records:
        for key, *_ in record_.marks:
            touched[key] = touched.get(key, 0) + 1
        for key, _ in record_.changed:
            touched.setdefault(key, 0)
    named = failure_blocks(explanation) if failing_column is not None else set()
    if failing_column is not None and not named:  # a crash names no block: those its call acted on
        named |= {key for key, *_ in records[failing_column].marks}
        if not named:  # nor did it act on any: the blocks of the sequences its call names
            call_text = columns[failing_column].call
            named |= {
                (DEVICE, block)
                for table in (columns[failing_column - 1].tables if failing_column else ())
                if repr(table.seq) in call_text
                for block in table.table
                if block != NULL_BLOCK
            }
    if len(touched) <= ALL_LANES_UP_TO:
        chosen = set(touched) | named
    else:
        chosen = set(named) or set(sorted(touched, key=lambda lane: -touched[lane])[:ALL_LANES_UP_TO])
        which = (
            "the failure involves (named by the violation or acted on by the failing call)" if named else "most active"
        )
        notes.append(f"{len(touched)} blocks were touched; the lanes show the {len(chosen)} {which}")
    for record_ in records:  # a copy's two blocks are drawn together: copy-on-write, fork copy, swap out and in
        for key, _, _, partner in record_.marks:
            if partner is not None and (key in chosen or partner in chosen):
                chosen |= {key, partner}
    allocator = recorder.engine.allocator
    name_of = allocator.library_block_name if isinstance(allocator, NamesLibraryBlocks) else None
    lanes = tuple(
        Lane(pool, block, _library_name(name_of, pool, block), (pool, block) in named)
        for pool, block in sorted(chosen, key=lambda lane: (lane[0] != DEVICE, lane[1]))
    )
    cells = []
    for lane in lanes:
        state = recorder.base.get(lane.key, EMPTY)
        row = []
        for record_ in records:
            for key, cell in record_.changed:
                if key == lane.key:
                    state = cell
            row.append(state)
        cells.append(tuple(row))
    shown = {lane.key for lane in lanes}
    marks = [
        Mark(index, pool, block, kind, text, partner if partner in shown else None)
        for index, record_ in enumerate(records)
        for (pool, block), kind, text, partner in record_.marks
        if (pool, block) in shown
    ]
    if failing_column is not None:
        summary = explanation.splitlines()[1].strip() if len(explanation.splitlines()) > 1 else explanation
        marks += [Mark(failing_column, lane.pool, lane.block, "failure", summary) for lane in lanes if lane.in_failure]
    outcome = Outcome(
        str(trace.failure.get("title")), trace.failure.get("invariant"), explanation, failing_column, verdict
    )
    return Timeline(
        source,
        spec,
        _setting(trace),
        trace.config.block_size,
        len(program),
        tuple(columns),
        lanes,
        tuple(cells),
        tuple(marks),
        outcome,
        tuple(notes),
    )


def _library_name(name_of: Optional[Callable[[int], str]], pool: str, block: int) -> Optional[str]:
    """The adapter's name for a device block in its library's own numbering (``library_block_name``), if any."""
    if pool != DEVICE or name_of is None:
        return None
    try:
        return str(name_of(block))
    except Exception:  # noqa: BLE001 -- a name is a courtesy; the lane keeps kvfuzz's id
        return None


def _setting(trace: Trace) -> str:
    config = trace.config
    window = f", W = {trace.recorded_window()}" if trace.recorded_window() is not None else ""
    return (
        f"{config.num_blocks} device blocks of {config.block_size} slots, {config.num_host_blocks} host blocks{window}"
    )


def _unreplayed(
    trace: Trace, source: str, spec: str, program: list[Call], recorded: str, notes: list[str], max_columns: int
) -> Timeline:
    first = max(0, len(program) - max_columns)
    columns = tuple(Column(first + index, str(call), call.rule, -1, ()) for index, call in enumerate(program[first:]))
    outcome = Outcome(str(trace.failure.get("title")), trace.failure.get("invariant"), recorded, None, "not replayed")
    return Timeline(
        source, spec, _setting(trace), trace.config.block_size, len(program), columns, (), (), (), outcome, tuple(notes)
    )
