"""The operation table: every operation a program may call, in one place.

Each :class:`~kvfuzz.engine.operation.Operation` names the capabilities and the state it needs, how each argument is
drawn, and what the engine does with it. The Hypothesis machine builds one rule per entry, random programs draw from
the enabled entries, replay validates a recorded call against the same entry, and the benchmark's bare machine reads
it too: enablement and validity are written nowhere else, and adding an operation is adding an entry.

The core's rows (what every allocator does) are here; a capability's rows are its feature's (``ROWS`` in each module
of :mod:`kvfuzz.engine.features` that brings an operation), beside the engine functions they call. The table is
assembled from both in the fixed order :data:`ORDER` names.
"""

from __future__ import annotations

from typing import Sequence

from kvfuzz.engine.arguments import (
    NAMESPACES,
    VOCABULARY,
    FilledPick,
    Integers,
    NewSeqId,
    Pick,
    TokenLists,
    computed,
    system_prompts,
)
from kvfuzz.engine.engine import Engine
from kvfuzz.engine.expected import ProgramState, Status
from kvfuzz.engine.features import eviction, forks, host_tier, preemption, rollback, swap
from kvfuzz.engine.misuse import misuse_calls
from kvfuzz.engine.operation import Operation

# -- the core's rows ------------------------------------------------------------------------------------------------


def _admit(engine: Engine, seq: str, namespace: tuple[str, ...], system: tuple[int, ...], suffix: list[int]) -> None:
    engine.admit(seq, namespace, system + tuple(suffix))


def _decode(engine: Engine, token: int) -> None:
    for seq in engine.expected.ids(Status.LOADED):  # the scheduler picks up requests whose loads have landed
        engine.resume(seq)
    for seq in engine.expected.computed_ids():
        engine.grow(seq, (token,))
    engine.step()


def _grown_tokens(state: ProgramState) -> tuple[tuple[int, int], ...]:
    """One token, or (half the time) a chunk or drafts of up to a block and one, unless every grow is one token."""
    return ((1, 1),) if state.caps.single_token_grow else ((1, 1), (2, state.block_size + 1))


def _namespaces(state: ProgramState) -> tuple[tuple[str, ...], ...]:
    return NAMESPACES if state.caps.namespaces else ((),)


def _running(state: ProgramState) -> list[str]:
    return state.ids(Status.RUNNING)


def _preempted(state: ProgramState) -> list[str]:
    return state.ids(Status.PREEMPTED)


CORE: tuple[Operation, ...] = (
    Operation(
        "admit",
        _admit,
        (
            ("seq", NewSeqId()),
            ("namespace", FilledPick(_namespaces)),
            ("system", FilledPick(lambda state: system_prompts(state.block_size))),
            ("suffix", TokenLists(lambda state: ((1, state.block_size + 2),))),
        ),
        doc="a request whose prompt is a shared system prompt followed by its own suffix",
    ),
    Operation("step", lambda engine: engine.step(), doc="one forward pass: new K/V written, every sequence attends"),
    Operation(
        "readmit",
        lambda engine, seq: engine.readmit(seq),
        (("seq", Pick(_preempted)),),
        doc="a preempted request comes back with every token it had",
    ),
    Operation(
        "grow",
        lambda engine, seq, tokens: engine.grow(seq, tuple(tokens)),
        (("seq", Pick(_running)), ("tokens", TokenLists(_grown_tokens))),
        doc="append one token (decode) half the time, else a chunk or a run of speculative drafts (always one token "
        "where the engine grows by one)",
    ),
    Operation(
        "decode",
        _decode,
        (("token", Integers(0, VOCABULARY - 1)),),
        condition=computed,
        doc="one continuous-batching iteration: sequences whose asynchronous loads landed are resumed, every computed "
        "sequence appends the token, then a step runs",
    ),
    Operation(
        "free",
        lambda engine, seq: engine.free(seq),
        (("seq", Pick(lambda state: state.freeable_ids())),),
        doc="the request finished or was cancelled, at any moment (only once computed where the engine has no abort)",
    ),
    Operation(
        "misuse",
        lambda engine, call: engine.misuse(call),
        (("call", FilledPick(misuse_calls)),),
        condition=lambda state: bool(state.live_ids() or state.ids(Status.PREEMPTED) or state.finished),
        doc="a call that breaks the contract: it must raise a Misuse error and change nothing",
    ),
)
"""The core's rows: every allocator is called through them."""

FEATURES: tuple[tuple[Operation, ...], ...] = (
    preemption.ROWS,
    forks.ROWS,
    swap.ROWS,
    rollback.ROWS,
    eviction.ROWS,
    host_tier.ROWS,
)
"""Every feature's rows of the operation table."""

ORDER: tuple[str, ...] = (
    "admit",
    "step",
    "readmit",
    "grow",
    "preempt",
    "decode",
    "fork",
    "swap_out",
    "free",
    "swap_in",
    "rollback",
    "evict",
    "evict_blocks",
    "reset_cache",
    "land_loads",
    "resume",
    "misuse",
)
"""The table's order, by operation name: the order in which the operations were added, with a few core ones early. It
is random programs' order of choices, so it is fixed: a seeded random program draws the same calls only while it
stays (Hypothesis orders its rules by name, whatever this order). A new operation goes at the end."""


def assembled(rows: Sequence[Operation], order: Sequence[str]) -> tuple[Operation, ...]:
    """``rows`` in ``order``; raises ValueError unless ``order`` names each row exactly once."""
    by_name = {row.name: row for row in rows}
    if len(by_name) != len(rows) or len(set(order)) != len(order) or set(by_name) != set(order):
        named = sorted(set(by_name) ^ set(order))
        raise ValueError(f"the operation table's ORDER and its rows disagree (names: {named}, or a name twice)")
    return tuple(by_name[name] for name in order)


OPERATIONS: tuple[Operation, ...] = assembled(CORE + tuple(row for rows in FEATURES for row in rows), ORDER)
"""The operation table."""

BY_NAME: dict[str, Operation] = {operation.name: operation for operation in OPERATIONS}
