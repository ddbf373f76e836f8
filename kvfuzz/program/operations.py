"""The operation table: every operation a program may call, in one place.

Each :class:`Operation` names the capabilities and the state it needs, how each argument is drawn, and what the
engine does with it. The Hypothesis machine builds one rule per entry, random programs draw from the enabled
entries, replay validates a recorded call against the same entry, and the benchmark's bare machine reads it too:
enablement and validity are written nowhere else, and adding an operation is adding an entry.

An operation is enabled when the allocator declares every capability in ``needs``, ``condition`` holds, and every
argument has something to draw from (a ``Pick`` over running sequences needs a running sequence). A recorded call is
valid when its operation is enabled and every argument is one the operation could have drawn in that state.
"""

from __future__ import annotations

from kvfuzz.engine.arguments import (
    NAMESPACES,
    VOCABULARY,
    BlockIds,
    Integers,
    NewSeqId,
    Pick,
    TokenLists,
    system_prompts,
)
from kvfuzz.engine.engine import Engine
from kvfuzz.engine.expected import ProgramState, Status
from kvfuzz.engine.features import eviction, forks, preemption, rollback, swap
from kvfuzz.engine.misuse import misuse_calls
from kvfuzz.engine.operation import Operation

# -- what each operation does --------------------------------------------------------------------------------------


def _admit(engine: Engine, seq: str, namespace: tuple[str, ...], system: tuple[int, ...], suffix: list[int]) -> None:
    engine.admit(seq, namespace, system + tuple(suffix))


def _decode(engine: Engine, token: int) -> None:
    for seq in engine.expected.ids(Status.LOADED):  # the scheduler picks up requests whose loads have landed
        engine.resume(seq)
    for seq in engine.expected.computed_ids():
        engine.grow(seq, (token,))
    engine.step()


def _fork(engine: Engine, parent: str, child: str) -> None:
    forks.fork(engine, engine.groups, parent, child)


def _swap_out(engine: Engine, seq: str) -> None:
    swap.swap_out(engine, seq)


def _swap_in(engine: Engine, seq: str) -> None:
    swap.swap_in(engine, seq)


def _rollback(engine: Engine, seq: str, num_tokens: int) -> None:
    rollback.rollback(engine, seq, min(num_tokens, engine.expected.rollback_limit(seq)))


def _grown_tokens(state: ProgramState) -> tuple[tuple[int, int], ...]:
    """One token, or (half the time) a chunk or drafts of up to a block and one, unless every grow is one token."""
    return ((1, 1),) if state.caps.single_token_grow else ((1, 1), (2, state.block_size + 1))


def _namespaces(state: ProgramState) -> tuple[tuple[str, ...], ...]:
    return NAMESPACES if state.caps.namespaces else ((),)


def _running(state: ProgramState) -> list[str]:
    return state.ids(Status.RUNNING)


def _preempted(state: ProgramState) -> list[str]:
    return state.ids(Status.PREEMPTED)


def _swapped(state: ProgramState) -> list[str]:
    return state.ids(Status.SWAPPED)


# The order is random programs' order of choices (Hypothesis orders rules by name).
OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "admit",
        _admit,
        (
            ("seq", NewSeqId()),
            ("namespace", Pick(_namespaces)),
            ("system", Pick(lambda state: system_prompts(state.block_size))),
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
        "preempt",
        lambda engine, seq: preemption.preempt(engine, seq),
        (("seq", Pick(lambda state: state.preemptible_ids())),),
        needs=("preemption",),
        doc="release a running sequence for recomputation",
    ),
    Operation(
        "decode",
        _decode,
        (("token", Integers(0, VOCABULARY - 1)),),
        condition=lambda state: bool(state.computed_ids()),
        doc="one continuous-batching iteration: sequences whose asynchronous loads landed are resumed, every computed "
        "sequence appends the token, then a step runs",
    ),
    Operation(
        "fork",
        _fork,
        (("parent", Pick(lambda state: state.computed_ids())), ("child", NewSeqId())),
        needs=("fork",),
        doc="parallel sampling or beam search: the child shares the parent's blocks",
    ),
    Operation(
        "swap_out",
        _swap_out,
        (("seq", Pick(lambda state: state.computed_ids())),),
        needs=("swap",),
        condition=lambda state: state.num_host_blocks > 0,
        doc="move a computed sequence's K/V to the host pool",
    ),
    Operation(
        "free",
        lambda engine, seq: engine.free(seq),
        (("seq", Pick(lambda state: state.freeable_ids())),),
        doc="the request finished or was cancelled, at any moment (only once computed where the engine has no abort)",
    ),
    Operation(
        "swap_in",
        _swap_in,
        (("seq", Pick(_swapped)),),
        needs=("swap",),
        doc="bring a swapped-out sequence back to the device",
    ),
    Operation(
        "rollback",
        _rollback,
        (("seq", Pick(lambda state: state.rollbackable_ids())), ("num_tokens", Integers(1, 6))),
        needs=("rollback",),
        doc="reject drafts: drop that many tokens, or as many as leave one (and, under a sliding window, no dropped "
        "block back in the window)",
    ),
    Operation(
        "evict",
        lambda engine, num_blocks: eviction.evict(engine, num_blocks),
        (("num_blocks", Integers(1, 4)),),
        needs=("eviction",),
        condition=lambda state: bool(state.finished),
        doc="drop up to that many cached, unreferenced blocks",
    ),
    Operation(
        "evict_blocks",
        lambda engine, blocks: eviction.evict_blocks(engine, tuple(blocks)),
        (("blocks", BlockIds(lambda state: state.released_blocks())),),
        needs=("targeted_eviction",),
        doc="drop particular blocks from the cache by id (a KV connector's or an offloader's eviction): picked "
        "among the blocks some sequence released, cached or not",
    ),
    Operation(
        "reset_cache",
        lambda engine: eviction.reset_cache(engine),
        needs=("eviction",),
        condition=lambda state: bool(state.finished),
        doc="drop every cached, unreferenced block",
    ),
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
    Operation(
        "misuse",
        lambda engine, call: engine.misuse(call),
        (("call", Pick(misuse_calls)),),
        condition=lambda state: bool(state.live_ids() or state.ids(Status.PREEMPTED) or state.finished),
        doc="a call that breaks the contract: it must raise a Misuse error and change nothing",
    ),
)

BY_NAME: dict[str, Operation] = {operation.name: operation for operation in OPERATIONS}
