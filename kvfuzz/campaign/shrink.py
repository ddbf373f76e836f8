"""Shrinking a failing program to a fixpoint: deleting calls, simplifying arguments and the configuration.

A program found by random search keeps calls, tokens and blocks that do not matter. Each pass below proposes
smaller candidates and keeps one only when its replay, on a fresh allocator, fails with the same
:class:`~kvfuzz.campaign.signature.Signature`. A deletion often strands a later call: one that could not be made
where it now stands (a readmission whose preemption the pool no longer forces, a decode with nothing computed, an
eviction of a block no longer released). The replay skips such a call, and the candidate is the calls it made (they
replay exactly, as saved): in a long program of preemptions and targeted evictions most candidates strand some call,
and throwing them away left delta debugging little to delete. The passes:

* delete calls: chunks of halving size down to single calls (delta debugging; with a chunk go the later calls of
  the sequences it admitted or forked), every window of two or three neighbouring calls, all the calls that name one
  sequence;
* delete every pair of distant calls naming one sequence (replays quadratic in the length);
* merge calls: a grow and the next grow of its sequence into one grow, an admit and the grow after it into an admit
  with the longer suffix (within the operations' bounds), a decode into a step;
* simplify arguments: shorter token lists (prompts, suffixes, tokens per grow), zero token values, smaller integers;
* renumber sequence ids in order of first use (``s0``, ``s1``, ...);
* simplify the configuration: fewer device blocks, fewer host blocks, a smaller block size, a smaller W (when the
  campaign chose W);
* a smaller pool (or W) and one call fewer together, where neither goes alone (a program building pool pressure).

Two things steer the candidates, from the run of the program kept last (its landmarks); neither decides what is
kept. A targeted eviction names blocks by id, and calls deleted before it change which block holds what it evicted:
each replay re-aims it at the released block that now holds the same K/V (``evict_blocks([9])`` becomes
``evict_blocks([0])`` once the admissions that pushed the content to block 9 are gone). And a program that fails
under pool pressure (every block mapped before its last call) stops failing when a deletion frees blocks: a
deleted candidate is tried in a pool as much smaller than what it maps in a roomy pool as the kept program's was,
so calls and blocks go together.

They repeat until none changes anything (the fixpoint) or the time bound runs out; the result says which. The
configuration is simplified first (a smaller pool makes every later replay cheaper). Distant pairs, merging and the
last pass run only once the others have reached their fixpoint, and the others run again after any change they
make.

A fixpoint is local: deleting calls cannot undo what a long random program happened to build first (a pool filled
by swaps where one admission would do). So a program still longer than :data:`LONG_PROGRAM` calls at its fixpoint is
shrunk again from other starting points (restarts): random programs of the campaign's swarm (its operations and
program length) under the shrunk configuration, until one fails with the same signature; the shortest fixpoint
wins. The failing programs of other signatures such a search meets are handed back, never dropped.
"""

from __future__ import annotations

import random
import re
import time
from typing import Any, Callable, Iterator, Optional, Sequence, cast

import attrs

from kvfuzz.allocator.types import PoolSpec
from kvfuzz.campaign.signature import Signature, signature_of
from kvfuzz.campaign.swarm import builds
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.misuse import MisuseCall
from kvfuzz.program.arguments import system_prompts
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Execution, Safeguards, Target
from kvfuzz.program.operations import BY_NAME, Operation
from kvfuzz.program.random_programs import random_program
from kvfuzz.program.replay import replay
from kvfuzz.program.safeguards import AllocatorHang
from kvfuzz.program.stats import RunStats
from kvfuzz.registry import AllocatorFactory

SEQ_ARGUMENTS = ("seq", "parent", "child")
"""Arguments that name a sequence, renumbered together."""
_SEQ_ID = re.compile(r"\bs[0-9]+\b")


LONG_PROGRAM = 5
"""A program longer than this many calls at its fixpoint is shrunk again from other failing programs (restarts)."""

RESTARTS = 3
"""Other failing programs one shrink starts from, at most."""

RESTART_SEARCH = 200
"""Random programs a restart tries to find one that fails with the same signature, before restarts give up."""

RESTART_SHORTEST = 8
"""The length of a restart search's first program; each next one may be a call longer, up to the swarm's program
length: a short failing program is a better start (and a short passing one a cheap miss)."""


@attrs.frozen
class Restarts:
    """Where a shrink finds other programs failing the same way: random programs of a campaign's swarm."""

    operations: tuple[Operation, ...]  # the swarm's operations
    program_length: int  # the swarm's program length
    rng: random.Random = attrs.field(eq=False)  # a stream of its own (the worker's seeds it from the signature)


@attrs.frozen
class Failing:
    """A failing program a restart search met with another signature than the one being shrunk (one per
    signature)."""

    config: MachineConfig
    calls: tuple[Call, ...]
    failure: BaseException
    signature: Signature  # as the program's own run named it


@attrs.frozen
class Shrunk:
    """The smallest program (and configuration) found failing with the same signature; ``stopped_early`` says why
    shrinking ended before its fixpoint (None: it reached it)."""

    config: MachineConfig
    calls: tuple[Call, ...]
    failure: BaseException  # what the final program raised on its last replay
    replays: int  # candidate programs replayed
    stopped_early: Optional[str] = None
    restarts: int = 0  # other failing programs shrunk from (the result is the shortest of every fixpoint)
    others: tuple[Failing, ...] = ()  # failures of other signatures met while searching for restarts, one each


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


class _Shrinker:
    """The state of one shrink: the replays' budget, and what the last kept candidate's run showed.

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
        self.deficit_of: Optional[_Kept] = None  # the landmarks whose deficit was measured
        self.deficit_blocks: Optional[int] = None  # that deficit (None: not a pool-pressure failure)

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

    def fails_shorter(self, config: MachineConfig, calls: Sequence[Call], min_blocks: int) -> Optional[_Kept]:
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
        if min_blocks <= blocks < config.num_blocks:
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

    def _kept(self, config: MachineConfig, run: _Run) -> Optional[_Kept]:
        if run.failure is None:
            return None
        found = signature_of(self.signature.allocator, run.failure, run.calls, run.failed_at)
        if found != self.signature:
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
        return _Run(outcome.failure, failed_at, tuple(made), mapped[0], evicted)

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


ROOM_PER_CALL = 8
"""Blocks a roomy pool adds per call of the program: more than one call maps (a decode grows every sequence by a
token, an admission its prompt), so a program there never runs short."""


def _roomy(config: MachineConfig, calls: Sequence[Call]) -> MachineConfig:
    return attrs.evolve(config, num_blocks=config.num_blocks + ROOM_PER_CALL * len(calls))


def _eviction_key(call: Call, made: Sequence[Call]) -> EvictionKey:
    return tuple(call.kwargs()["blocks"]), sum(1 for earlier in made if earlier == call)


def shrink(
    factory: AllocatorFactory,
    config: MachineConfig,
    calls: Sequence[Call],
    failure: BaseException,
    signature: Signature,
    *,
    seconds: float,
    min_blocks: int = 1,
    block_sizes: Sequence[int] = (),
    safeguards: Safeguards = Safeguards(),
    stop: Callable[[], bool] = lambda: False,
    stats: Optional[RunStats] = None,
    restarts: Optional[Restarts] = None,
) -> Shrunk:
    """Shrink ``calls`` under ``config`` (which fail with ``signature``) to a fixpoint of every pass, within
    ``seconds``; never below ``min_blocks`` device blocks, and only to block sizes in ``block_sizes``. With
    ``restarts``, a fixpoint longer than :data:`LONG_PROGRAM` calls is shrunk again from other failing programs."""
    shrinker = _Shrinker(config, factory, signature, safeguards, seconds, stop, stats)
    limits = (min_blocks, tuple(block_sizes))
    shrinker.fails(config, calls)  # its run steers the first candidates (the landmarks)
    best, stopped = _fixpoint(shrinker, (config, tuple(calls), failure), *limits)
    others: list[Failing] = []
    started = 0
    while restarts is not None and stopped is None and len(best[1]) > LONG_PROGRAM and started < RESTARTS:
        found = _another_program(shrinker, best[0], best[1], restarts, others)
        if found is None:
            break
        started += 1
        candidate, candidate_stopped = _fixpoint(shrinker, found, *limits)
        if len(candidate[1]) < len(best[1]):
            best, stopped = candidate, candidate_stopped
        elif candidate_stopped is not None:
            break  # out of time: the best so far did reach its fixpoint
    note = None if stopped is None else f"shrinking stopped early: {stopped}"
    return Shrunk(best[0], best[1], best[2], shrinker.replays, note, started, tuple(others))


_Best = tuple[MachineConfig, tuple[Call, ...], BaseException]


def _fixpoint(
    shrinker: _Shrinker, best: _Best, min_blocks: int, block_sizes: tuple[int, ...]
) -> tuple[_Best, Optional[str]]:
    """Every pass until none changes anything; with why it stopped before that (None: the fixpoint)."""
    # The first passes run to their fixpoint before the others are tried: those move a program from one fixpoint
    # of the first to another, and never lengthen it, so a shrink never ends longer than the first passes alone.
    stages = (
        (_simplify_config, _delete_calls, _simplify_arguments, _simplify_shared_values, _renumber),
        (_delete_distant_pairs, _merge_calls, _smaller_pool_fewer_calls),
    )
    while True:
        before = best[:2]
        for stage in stages:
            for shrink_pass in stage:
                if shrinker.out_of_time():
                    return best, shrinker.why_stopped()
                best = shrink_pass(shrinker, best, min_blocks, block_sizes)
            if best[:2] != before:
                break
        if best[:2] == before:
            return best, None


def _another_program(
    shrinker: _Shrinker, config: MachineConfig, calls: tuple[Call, ...], restarts: Restarts, others: list[Failing]
) -> Optional[_Best]:
    """A random program of the swarm (with the operations ``calls`` make too: a program found by Hypothesis draws
    from every rule) that fails with the signature, or None (none within :data:`RESTART_SEARCH` programs, out of
    time, or a hang); drawn under ``config`` and, every other time, under the configuration the failure was found in
    (a simpler pool can make the failure rare: no host blocks leaves no swap to free blocks with). A failure of
    another signature goes to ``others`` (once per signature)."""
    operations = tuple(dict.fromkeys((*restarts.operations, *(BY_NAME[call.rule] for call in calls))))
    configs = tuple(dict.fromkeys((config, shrinker.found_in)))
    for attempt in range(RESTART_SEARCH):
        if shrinker.out_of_time():
            return None
        config = configs[attempt % len(configs)]
        try:
            length = min(restarts.program_length, RESTART_SHORTEST + attempt)
            found = random_program(shrinker.target(config), restarts.rng, length, operations)
        except AllocatorHang as hang:  # every further program may hang too: no more restarts
            stats = shrinker.stats
            if stats is not None and stats.last_failing_program:
                hung = tuple(stats.last_failing_program)
                others.append(Failing(config, hung, hang, signature_of(shrinker.signature.allocator, hang, hung, None)))
            return None
        if found is None:
            continue
        kept = shrinker.fails(config, found.calls)
        if kept is not None:
            return config, kept.calls, kept.failure
        met = signature_of(shrinker.signature.allocator, found.failure, found.calls, None)
        if met != shrinker.signature and all(met != other.signature for other in others):
            others.append(Failing(config, found.calls, found.failure, met))
    return None


def _delete_calls(shrinker: _Shrinker, best: _Best, min_blocks: int, block_sizes: tuple[int, ...]) -> _Best:
    """Delta debugging: chunks of halving size (each with the later calls of the sequences it brought in), then
    every window of two or three neighbouring calls (a preempt and its readmit go together), then every sequence's
    calls at once (an admit and everything naming it). Each costs a number of replays about linear in the program's
    length; distant pairs, quadratic, are a later pass."""
    config, calls, failure = best
    current = list(calls)
    chunk = max(1, len(current) // 2)
    while chunk >= 1 and not shrinker.out_of_time():
        start, deleted = 0, False
        while start < len(current) and not shrinker.out_of_time():
            candidate = _without_chunk(current, start, start + chunk)
            found = shrinker.fails_shorter(config, candidate, min_blocks) if candidate else None
            if found is not None:
                config, current, failure, deleted = found.config, list(found.calls), found.failure, True
            else:
                start += chunk
        if not deleted:
            chunk //= 2
    for width in (2, 3):
        start = 0
        while start + width <= len(current) and not shrinker.out_of_time():
            candidate = current[:start] + current[start + width :]
            found = shrinker.fails_shorter(config, candidate, min_blocks) if candidate else None
            if found is not None:
                config, current, failure = found.config, list(found.calls), found.failure
            else:
                start += 1
    for seq in sorted({name for call in current for name in _sequences(call)}):
        if shrinker.out_of_time():
            break
        candidate = [call for call in current if seq not in _sequences(call)]
        shorter = candidate and len(candidate) < len(current)
        found = shrinker.fails_shorter(config, candidate, min_blocks) if shorter else None
        if found is not None:
            config, current, failure = found.config, list(found.calls), found.failure
    return config, tuple(current), failure


def _without_chunk(calls: list[Call], start: int, end: int) -> list[Call]:
    """``calls`` less those from ``start`` to ``end`` and every later call naming a sequence one of those brought
    in (admitted, or forked as a child), transitively: without its admission such a call could not be made, so a
    chunk deleted alone would leave a program that cannot be replayed."""
    born = {name for call in calls[start:end] for name in _introduced(call)}
    kept = calls[:start]
    for call in calls[end:]:
        if _sequences(call) & born:
            born.update(_introduced(call))
        else:
            kept.append(call)
    return kept


def _introduced(call: Call) -> set[str]:
    """The sequence a call brings in: an admission's, a fork's child."""
    argument = {"admit": "seq", "fork": "child"}.get(call.rule)
    name = None if argument is None else call.kwargs().get(argument)
    return {name} if isinstance(name, str) else set()


def _delete_distant_pairs(shrinker: _Shrinker, best: _Best, min_blocks: int, block_sizes: tuple[int, ...]) -> _Best:
    """Every pair of calls naming one sequence, three or more calls apart (a preempt and its readmit with other
    work between them, an admission and the free that undoes it); closer pairs are the windows' job. Its replays
    grow with the square of the program's length, so it runs once the linear passes have reached their fixpoint
    (on a long program in a large pool it would otherwise spend the time bound before the pool gets smaller)."""
    config, calls, failure = best
    current, first = list(calls), 0
    while first < len(current) and not shrinker.out_of_time():
        names, deleted = _sequences(current[first]), False
        for second in range(first + 3, len(current)):
            if shrinker.out_of_time():
                break
            if names & _sequences(current[second]):
                candidate = current[:first] + current[first + 1 : second] + current[second + 1 :]
                found = shrinker.fails_shorter(config, candidate, min_blocks)
                if found is not None:
                    config, current, failure, deleted = found.config, list(found.calls), found.failure, True
                    break
        if not deleted:
            first += 1
    return config, tuple(current), failure


def _merge_calls(shrinker: _Shrinker, best: _Best, min_blocks: int, block_sizes: tuple[int, ...]) -> _Best:
    """Replace calls by fewer or simpler ones with the same effect on the pool: a grow and the next call naming its
    sequence, when that is a grow too, by one grow of both token lists (in the first's place or the second's); an
    admit and a grow that follows it by an admit with the longer suffix; a decode by a step (the tokens it appends
    are not always what the failure needs). A merged list longer than the operation draws makes the candidate
    invalid (replay refuses it), never a finding."""
    config, calls, failure = best
    current, index = list(calls), 0
    while index < len(current) and not shrinker.out_of_time():
        for candidate in _merges(current, index):
            found = shrinker.fails(config, candidate)
            if found is not None:
                current, failure = list(found.calls), found.failure
                break
        else:
            index += 1
    return config, tuple(current), failure


def _merges(calls: list[Call], index: int) -> Iterator[list[Call]]:
    """The candidates :func:`_merge_calls` tries for the call at ``index``, each a whole program."""
    call = calls[index]
    before, after = calls[:index], calls[index + 1 :]
    if call.rule == "decode":
        yield before + [Call("step", {})] + after
        return
    if call.rule not in ("admit", "grow"):
        return
    seq = call.kwargs()["seq"]
    later = next((position for position, other in enumerate(after) if seq in _sequences(other)), None)
    if later is None or after[later].rule != "grow":
        return
    field = "suffix" if call.rule == "admit" else "tokens"
    merged = Call(call.rule, {**call.kwargs(), field: [*call.kwargs()[field], *after[later].kwargs()["tokens"]]})
    between, rest = after[:later], after[later + 1 :]
    yield before + [merged] + between + rest
    if between:
        yield before + between + [merged] + rest


def _sequences(call: Call) -> set[str]:
    """The sequence ids a call names (in its arguments, or inside a misuse call)."""
    names: set[str] = set()
    for name, value in call.arguments:
        if name in SEQ_ARGUMENTS and isinstance(value, str):
            names.add(value)
        elif isinstance(value, MisuseCall):
            names.update(_SEQ_ID.findall(" ".join(str(item) for item in value.args)))
    return names


def _smaller(value: Any) -> Iterator[Any]:
    """Simpler values of one argument, simplest first: shorter lists (of tokens, of namespace parts), zero tokens,
    smaller integers."""
    if isinstance(value, (MisuseCall, str, bool)):
        return
    if type(value) is int:
        yield from sorted({candidate for candidate in (0, 1, value // 2, value - 1) if 0 <= candidate < value})
        return
    if not isinstance(value, (list, tuple)):
        return
    kind = type(value)
    candidates = [value[:0], value[: len(value) // 2], value[:-1], value[1:]]
    if all(type(item) is int for item in value):
        candidates.append(kind(0 for _ in value))
        candidates += [
            kind(0 if index == position else item for index, item in enumerate(value))
            for position in range(len(value))
            if value[position]
        ]
    seen = {tuple(value)}
    for candidate in candidates:
        if tuple(candidate) not in seen:
            seen.add(tuple(candidate))
            yield kind(candidate)


def _simplify_arguments(shrinker: _Shrinker, best: _Best, min_blocks: int, block_sizes: tuple[int, ...]) -> _Best:
    config, calls, failure = best
    current = list(calls)
    for index in range(len(current)):
        for name in [name for name, _ in current[index].arguments]:
            improved = True
            while improved and not shrinker.out_of_time():
                improved = False
                for candidate in _smaller(current[index].kwargs()[name]):
                    trial = current[:index] + [Call(current[index].rule, {**current[index].kwargs(), name: candidate})]
                    trial += current[index + 1 :]
                    found = shrinker.fails(config, trial, reaim=False)
                    if found is not None:
                        current, failure, improved = trial, found.failure, True
                        break
    return config, tuple(current), failure


def _simplify_shared_values(shrinker: _Shrinker, best: _Best, min_blocks: int, block_sizes: tuple[int, ...]) -> _Best:
    """A value several calls share (the namespace and system prompt of two admissions whose hit the failure needs)
    simplified in all of them at once, where changing one alone breaks what they share."""
    config, calls, failure = best
    current = list(calls)
    shared: dict[tuple[str, str, Any], int] = {}
    for call in current:
        for name, value in call.arguments:
            if name not in SEQ_ARGUMENTS and not isinstance(value, (MisuseCall, list)):
                key = (call.rule, name, value)
                shared[key] = shared.get(key, 0) + 1
    for (rule, name, value), count in shared.items():
        if count < 2:
            continue
        for candidate in _smaller(value):
            if shrinker.out_of_time():
                return config, tuple(current), failure
            trial = [
                Call(call.rule, {**call.kwargs(), name: candidate})
                if call.rule == rule and call.kwargs().get(name) == value
                else call
                for call in current
            ]
            found = shrinker.fails(config, trial, reaim=False)
            if found is not None:
                current, failure = trial, found.failure
                break
    return config, tuple(current), failure


def renumbered(calls: Sequence[Call]) -> list[Call]:
    """``calls`` with sequence ids renamed ``s0``, ``s1``, ... in order of first use (in misuse calls too)."""
    names: dict[str, str] = {}

    def rename(text: str) -> str:
        return _SEQ_ID.sub(lambda match: names.setdefault(match.group(0), f"s{len(names)}"), text)

    def value_of(name: str, value: Any) -> Any:
        if name in SEQ_ARGUMENTS and isinstance(value, str):
            return rename(value)
        if isinstance(value, MisuseCall):
            args = tuple(rename(item) if isinstance(item, str) else item for item in value.args)
            return MisuseCall(value.op, args, rename(value.why))
        return value

    return [Call(call.rule, {name: value_of(name, value) for name, value in call.arguments}) for call in calls]


def _renumber(shrinker: _Shrinker, best: _Best, min_blocks: int, block_sizes: tuple[int, ...]) -> _Best:
    config, calls, failure = best
    candidate = renumbered(calls)
    if candidate == list(calls):
        return best
    found = shrinker.fails(config, candidate)
    return (config, found.calls, found.failure) if found is not None else best


def _simplify_config(shrinker: _Shrinker, best: _Best, min_blocks: int, block_sizes: tuple[int, ...]) -> _Best:
    config, calls, failure = best
    fields = [("num_blocks", min_blocks), ("num_host_blocks", 0), ("block_size", 1)]
    if config.inflight_window is not None:  # a W the campaign asked for (the factory builds any): a smaller one
        fields.append(("inflight_window", 0))
    for name, lowest in fields:
        improved = True
        while improved and not shrinker.out_of_time():
            improved = False
            value = getattr(config, name)
            if name == "block_size" and block_sizes:
                options = sorted(size for size in block_sizes if size < value)
            else:
                options = _smaller_counts(value, lowest)
            for smaller in options:
                trial = attrs.evolve(config, **cast(dict[str, Any], {name: smaller}))
                programs = _at_block_size(calls, value, smaller) if name == "block_size" else [calls]
                for program in programs:
                    found = shrinker.fails(trial, program)
                    if found is not None:
                        config, calls, failure, improved = trial, found.calls, found.failure, True
                        break
                if improved:
                    break
    return config, calls, failure


def _smaller_counts(value: int, lowest: int) -> list[int]:
    """Smaller values of a count (blocks, W), smallest first: the lowest, then halfway, three quarters, seven
    eighths ... of the way up, then one less; a pool that must keep most of its blocks reaches its smallest size in
    a few halvings of the distance instead of one block at a time."""
    options = {lowest, value // 2, value - 1}
    gap = value - lowest
    while gap > 1:
        gap //= 2
        options.add(value - gap)
    return sorted(option for option in options if lowest <= option < value)


def _at_block_size(calls: tuple[Call, ...], old: int, new: int) -> list[tuple[Call, ...]]:
    """``calls`` rewritten for blocks of ``new`` slots instead of ``old``, as candidates, the likeliest first.

    A shared system prompt is drawn among prompts that end just below, at or past a block boundary
    (:func:`~kvfuzz.program.arguments.system_prompts`), so each becomes the new size's prompt of the same role. Token
    lists (suffixes, grown tokens) then either keep their length in blocks (scaled, at least one token: a program
    building pool pressure still fills as many blocks) or keep their tokens (cut to the new size's bounds; replay
    refuses a list still too long)."""
    roles: dict[int, int] = {}
    for index, prompt in enumerate(_prompts_by_role(old)):
        roles.setdefault(len(prompt), index)
    renamed = _prompts_by_role(new)

    def rewrite(call: Call, scale: bool) -> Call:
        arguments = dict(call.kwargs())
        system = arguments.get("system")
        if isinstance(system, (list, tuple)) and len(system) in roles:
            arguments["system"] = type(system)(renamed[roles[len(system)]])
        for name in ("suffix", "tokens"):
            tokens = arguments.get(name)
            if isinstance(tokens, list) and tokens:
                length = max(1, -(-len(tokens) * new // old)) if scale else min(len(tokens), new + 2)
                arguments[name] = tokens[:length]
        return Call(call.rule, arguments)

    candidates: list[tuple[Call, ...]] = []
    for scale in (True, False):
        candidate = tuple(rewrite(call, scale) for call in calls)
        if candidate not in candidates:
            candidates.append(candidate)
    return candidates


def _prompts_by_role(block_size: int) -> tuple[tuple[int, ...], ...]:
    """The system prompts of one block size by role: empty, a block less one token, one block, two blocks, two
    blocks and one token (at one slot per block the first two coincide; the empty prompt keeps role 0)."""
    by_length = {len(prompt): prompt for prompt in system_prompts(block_size)}
    lengths = (0, block_size - 1, block_size, 2 * block_size, 2 * block_size + 1)
    return tuple(by_length[length] for length in lengths)


def _smaller_pool_fewer_calls(shrinker: _Shrinker, best: _Best, min_blocks: int, block_sizes: tuple[int, ...]) -> _Best:
    """A smaller pool (fewer device blocks, or a smaller W the campaign chose) together with one call fewer, for
    programs that build pool pressure or age blocks through the in-flight window: there, a smaller pool alone
    changes when a refusal comes and deleting any one call alone undoes the pressure, while both together keep the
    failure. The first pair that still fails is kept (the passes then run again)."""
    config, calls, failure = best
    fields = [("num_blocks", min_blocks)]
    if config.inflight_window is not None:
        fields.append(("inflight_window", 0))
    for name, lowest in fields:
        value = getattr(config, name)
        for smaller in sorted({v for v in (lowest, value // 2, value - 1) if lowest <= v < value}, reverse=True):
            trial = attrs.evolve(config, **cast(dict[str, Any], {name: smaller}))
            for index in range(len(calls)):
                if shrinker.out_of_time():
                    return best
                candidate = calls[:index] + calls[index + 1 :]
                found = shrinker.fails(trial, candidate) if candidate else None
                if found is not None:
                    return trial, found.calls, found.failure
    return best
