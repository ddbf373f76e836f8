"""Replaying a shrinker's candidates: the state of one shrink (its time bound, its replays, the run of the program
kept last), and how a candidate is replayed and judged.

A candidate is kept only when its own replay, on a fresh allocator, fails with the shrink's signature. Two things
steer the candidates, from the run of the program kept last (its landmarks); neither decides what is kept. A targeted
eviction names blocks by id, and calls deleted before it change which block holds what it evicted: each replay
re-aims it at the released block that now holds the same K/V (``evict_blocks([9])`` becomes ``evict_blocks([0])``
once the admissions that pushed the content to block 9 are gone). And a program that fails under pool pressure (every
block mapped before its last call) stops failing when a deletion frees blocks: a deleted candidate is tried in a pool
as much smaller than what it maps in a roomy pool as the kept program's was, so calls and blocks go together.
"""

from __future__ import annotations

import re
import time
from typing import Callable, Optional, Sequence

import attrs

from kvfuzz.allocator.types import PoolSpec
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.misuse import MisuseCall
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Execution, Safeguards, Target
from kvfuzz.program.replay import Divergence, replay
from kvfuzz.program.stats import RunStats
from kvfuzz.registry import AllocatorFactory, builds
from kvfuzz.shrink.signature import Signature, signature_of

SEQ_ARGUMENTS = ("seq", "parent", "child")
"""Arguments that name a sequence, renumbered together."""
SEQ_ID = re.compile(r"\bs[0-9]+\b")
"""A sequence id inside a misuse call's text."""

Best = tuple[MachineConfig, tuple[Call, ...], BaseException]
"""The program a shrink holds: its configuration, its calls and what their last replay raised."""


def sequences(call: Call) -> set[str]:
    """The sequence ids a call names (in its arguments, or inside a misuse call)."""
    names: set[str] = set()
    for name, value in call.arguments:
        if name in SEQ_ARGUMENTS and isinstance(value, str):
            names.add(value)
        elif isinstance(value, MisuseCall):
            names.update(SEQ_ID.findall(" ".join(str(item) for item in value.args)))
    return names


BlockTags = tuple[Optional[int], ...]
"""What a device block holds: the tag of each slot's K/V (None: never written)."""

EvictionKey = tuple[tuple[int, ...], int]
"""A targeted eviction in a program: the blocks it names, and how many equal calls came before it."""


@attrs.frozen
class _Kept:
    """A candidate that failed with the signature, as replayed (its targeted evictions re-aimed), with what its run
    showed that steers the next candidates."""

    config: MachineConfig
    calls: tuple[Call, ...]  # the calls made: a kept program replays exactly
    failure: BaseException
    mapped_before_last: int  # blocks some table had mapped before its last call (all of them: pool pressure)
    evicted: dict[EvictionKey, tuple[BlockTags, ...]]  # what each targeted eviction's blocks held when it ran


@attrs.frozen
class _Run:
    """One replay of a candidate that could be made to its end or its failure."""

    failure: Optional[BaseException]
    failed_at: Optional[int]
    calls: tuple[Call, ...]  # the calls made
    mapped_before_last: int
    evicted: dict[EvictionKey, tuple[BlockTags, ...]]
    diverged: Optional[Divergence]  # where the replay's audit first failed, at an index of the calls made


class Shrinker:
    """The state of one shrink in the configuration the failure was found in (``kvfuzz run``'s, which the user
    chose): the replays' budget, and what the last kept candidate's run showed.

    Invariant kept: ``landmarks`` is the run of the last candidate that failed with ``signature`` (the program the
    passes are shrinking, except briefly after a restart's fixpoint came out longer); candidates are steered by it,
    never judged by it: a candidate is kept only when its own replay fails with the signature."""

    def __init__(
        self,
        found_in: MachineConfig,
        factory: AllocatorFactory,
        signature: Signature,
        safeguards: Safeguards,
        seconds: float,
        stop: Callable[[], bool],
        stats: Optional[RunStats],
    ) -> None:
        self.found_in = found_in  # the configuration the failure was found in
        self.factory = factory  # builds a fresh allocator for every replay
        self.signature = signature  # what every kept candidate fails with
        self.safeguards = safeguards  # the worker's watchdog and journal
        self.seconds = seconds  # the time bound
        self.deadline = time.perf_counter() + seconds  # perf_counter time the shrink must end by
        self.stop = stop  # the campaign asks the shrink to end now
        self.stats = stats  # counts the replays' steps
        self.replays = 0
        self.built: dict[PoolSpec, bool] = {}  # whether the factory builds each pool asked of it so far
        self.landmarks: Optional[_Kept] = None  # the last candidate kept

    def builds(self, config: MachineConfig) -> bool:
        """Whether the factory builds this configuration's pool (some refuse counts of blocks their sectors cannot
        fill): a smaller pool it refuses is no candidate."""
        pool = config.pool_spec()
        if pool not in self.built:
            self.built[pool] = builds(self.signature.allocator, self.factory, pool)
        return self.built[pool]

    def out_of_time(self) -> bool:
        return time.perf_counter() >= self.deadline or self.stop()

    def why_stopped(self) -> str:
        return "the campaign ended" if self.stop() else f"its time bound ({self.seconds:g} s) ran out"

    def target(self, config: MachineConfig) -> Target:
        """Where a candidate runs: journalled under its own configuration, so a death in a smaller pool is
        recovered with that pool."""
        return Target(self.factory, config, self.stats, self.safeguards)

    def fails(self, config: MachineConfig, calls: Sequence[Call], reaim: bool = True) -> Optional[_Kept]:
        """The candidate as replayed, if it fails with the signature (it becomes the landmarks); None otherwise.
        Without ``reaim`` its targeted evictions are made as they are (a pass trying smaller block ids)."""
        run = self.run(config, calls, reaim)
        return None if run is None else self._kept(config, run)

    def fails_shorter(self, config: MachineConfig, calls: Sequence[Call]) -> Optional[_Kept]:
        """:meth:`fails` for a candidate with calls deleted (in the same configuration)."""
        return self.fails(config, calls)

    def judged(self, config: MachineConfig, calls: Sequence[Call]) -> tuple[Optional[_Kept], Optional[Signature]]:
        """:meth:`fails`, with the signature the candidate's replay failed with (None: it passed, or was not run):
        a program of another signature is signed as its own replay audited it."""
        run = self.run(config, calls)
        if run is None:
            return None, None
        return self._kept(config, run), self._signed(run)

    def _signed(self, run: _Run) -> Optional[Signature]:
        if run.failure is None:
            return None
        return signature_of(self.signature.allocator, run.failure, run.calls, run.failed_at, run.diverged)

    def _kept(self, config: MachineConfig, run: _Run) -> Optional[_Kept]:
        if run.failure is None or self._signed(run) != self.signature:
            return None
        self.landmarks = _Kept(config, run.calls, run.failure, run.mapped_before_last, run.evicted)
        return self.landmarks

    def run(self, config: MachineConfig, calls: Sequence[Call], reaim: bool = True) -> Optional[_Run]:
        """Replay a candidate on a fresh allocator, re-aiming its targeted evictions and skipping the calls that
        cannot be made where they stand; the run's calls are those made (None: the factory does not build its
        pool)."""
        if not self.builds(config):
            return None
        self.replays += 1
        made: list[Call] = []
        evicted: dict[EvictionKey, tuple[BlockTags, ...]] = {}
        mapped = [0]

        def rewrite(index: int, call: Call, execution: Execution) -> Call:
            if index == len(calls) - 1:
                mapped[0] = execution.engine.expected.refs.num_ever_mapped()
            if call.rule == "evict_blocks":
                call = self._reaimed(call, made, execution, evicted, reaim)
            return call

        outcome = replay(
            self.target(config), calls, on_call=lambda _, call: made.append(call), rewrite=rewrite, skip_stranded=True
        )
        failed_at = outcome.failed_at
        if failed_at is not None:  # an index into the calls made: the failing call is the last made, or teardown
            failed_at = len(made) - 1 if failed_at < len(calls) else len(made)
        return _Run(outcome.failure, failed_at, tuple(made), mapped[0], evicted, outcome.diverged)

    def _reaimed(
        self,
        call: Call,
        made: list[Call],
        execution: Execution,
        evicted: dict[EvictionKey, tuple[BlockTags, ...]],
        reaim: bool,
    ) -> Call:
        """A targeted eviction aimed at the blocks that now hold what its blocks held in the program kept last
        (the calls deleted before it changed which block that is); what its blocks hold is recorded."""
        pools, released = execution.engine.pools, execution.engine.expected.released_blocks()
        blocks = call.kwargs()["blocks"]
        landmarks = self.landmarks if reaim else None
        intended = None if landmarks is None else landmarks.evicted.get(_eviction_key(call, made))
        if intended is not None and len(intended) == len(blocks):
            aimed: list[int] = []
            for block, tags in zip(blocks, intended):
                if pools.block_tags(block) != tags and any(tag is not None for tag in tags):
                    holders = (other for other in released if other not in aimed and pools.block_tags(other) == tags)
                    block = next(holders, block)
                aimed.append(block)
            if aimed != list(blocks):
                call = Call(call.rule, {**call.kwargs(), "blocks": type(blocks)(aimed)})
        blocks = call.kwargs()["blocks"]
        evicted[_eviction_key(call, made)] = tuple(pools.block_tags(block) for block in blocks)
        return call


@attrs.frozen
class Pools:
    """The configurations a shrink may move a failure to (a campaign's, which drew the configuration): never below
    ``min_blocks`` device blocks, and only to block sizes in ``block_sizes`` (none listed: any the factory builds);
    fewer host blocks and, when the configuration asked for one, a smaller W."""

    min_blocks: int = 1
    block_sizes: tuple[int, ...] = ()


class PoolShrinker(Shrinker):
    """A shrink that may also change the configuration, within ``pools``: a candidate with calls deleted from a
    program that fails under pool pressure is tried in a smaller pool too.

    Invariant kept (beside :class:`Shrinker`'s): ``deficit_blocks`` is the deficit of ``deficit_of``, the landmarks
    it was measured for."""

    def __init__(
        self,
        found_in: MachineConfig,
        factory: AllocatorFactory,
        signature: Signature,
        safeguards: Safeguards,
        seconds: float,
        stop: Callable[[], bool],
        stats: Optional[RunStats],
        pools: Pools,
    ) -> None:
        super().__init__(found_in, factory, signature, safeguards, seconds, stop, stats)
        self.pools = pools  # the configurations candidates may run in
        self.deficit_of: Optional[_Kept] = None  # the landmarks whose deficit was measured
        self.deficit_blocks: Optional[int] = None  # that deficit (None: not a pool-pressure failure)

    def fails_shorter(self, config: MachineConfig, calls: Sequence[Call]) -> Optional[_Kept]:
        """:meth:`fails` for a candidate with calls deleted. When the program kept last fails under pool pressure
        (every block mapped before its last call, and more wanted: its :meth:`deficit`), fewer calls want fewer
        blocks and the same pool no longer runs short where it did: the candidate is tried in a pool as much
        smaller than what it maps in a roomy one as the kept program's was, then in the same pool (and kept in the
        roomy one if it fails there: the pressure was not what the failure needed, and the configuration pass
        shrinks the pool)."""
        deficit = self.deficit(config)
        if deficit is None:
            return self.fails(config, calls)
        roomy_config = _roomy(config, calls)
        roomy = self.run(roomy_config, calls)
        if roomy is None:  # the factory does not build so large a pool
            return self.fails(config, calls)
        kept = self._kept(roomy_config, roomy)  # the pressure was not what it needed: the pool shrinks later
        if kept is not None:
            return kept
        blocks = roomy.mapped_before_last - deficit
        if self.pools.min_blocks <= blocks < config.num_blocks:
            kept = self.fails(attrs.evolve(config, num_blocks=blocks), calls)
        return kept if kept is not None else self.fails(config, calls)

    def deficit(self, config: MachineConfig) -> Optional[int]:
        """How many blocks more than ``config``'s pool the program kept last maps before its last call in a roomy
        pool, if it fails under pool pressure in ``config`` (None otherwise, or if even the roomy pool fills)."""
        landmarks = self.landmarks
        if landmarks is None or landmarks.config != config or landmarks.mapped_before_last < config.num_blocks:
            return None
        if self.deficit_of is not landmarks:
            roomy_config = _roomy(config, landmarks.calls)
            roomy = self.run(roomy_config, landmarks.calls)
            wanted = None if roomy is None else roomy.mapped_before_last
            self.deficit_of = landmarks
            self.deficit_blocks = None
            if wanted is not None and config.num_blocks < wanted < roomy_config.num_blocks:
                self.deficit_blocks = wanted - config.num_blocks
        return self.deficit_blocks


ROOM_PER_CALL = 8
"""Blocks a roomy pool adds per call of the program: more than one call maps (a decode grows every sequence by a
token, an admission its prompt), so a program there never runs short."""


def _roomy(config: MachineConfig, calls: Sequence[Call]) -> MachineConfig:
    return attrs.evolve(config, num_blocks=config.num_blocks + ROOM_PER_CALL * len(calls))


def _eviction_key(call: Call, made: Sequence[Call]) -> EvictionKey:
    return tuple(call.kwargs()["blocks"]), sum(1 for earlier in made if earlier == call)
