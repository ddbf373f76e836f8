"""Shrinking a failing program to a fixpoint: deleting calls, simplifying arguments and the configuration.

A program found by random search keeps calls, tokens and blocks that do not matter. Each pass below proposes
smaller candidates and keeps one only when its replay, on a fresh allocator, fails with the same
:class:`~kvfuzz.campaign.signature.Signature`; a candidate whose calls no longer make sense (a grow of a sequence
never admitted, a swap without host blocks) is never taken for a finding. The passes:

* delete calls: chunks of halving size down to single calls (delta debugging), every window of two or three
  neighbouring calls, all the calls that name one sequence, and every pair of distant calls naming one sequence;
* merge calls: a grow and the next grow of its sequence into one grow, an admit and the grow after it into an admit
  with the longer suffix (within the operations' bounds), a decode into a step;
* simplify arguments: shorter token lists (prompts, suffixes, tokens per grow), zero token values, smaller integers;
* renumber sequence ids in order of first use (``s0``, ``s1``, ...);
* simplify the configuration: fewer device blocks, fewer host blocks, a smaller block size, a smaller W (when the
  campaign chose W);
* a smaller pool (or W) and one call fewer together, where neither goes alone (a program building pool pressure).

They repeat until none changes anything (the fixpoint) or the time bound runs out; the result says which. The last
two run only once the others have reached their fixpoint, and the others run again after any change they make.
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable, Iterator, Optional, Sequence, cast

import attrs

from kvfuzz.campaign.signature import Signature, signature_of
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.misuse import MisuseCall
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Safeguards, Target
from kvfuzz.program.replay import NotApplicable, replay
from kvfuzz.program.stats import RunStats
from kvfuzz.registry import AllocatorFactory

SEQ_ARGUMENTS = ("seq", "parent", "child")
"""Arguments that name a sequence, renumbered together."""
_SEQ_ID = re.compile(r"\bs[0-9]+\b")


@attrs.frozen
class Shrunk:
    """The smallest program (and configuration) found failing with the same signature; ``stopped_early`` says why
    shrinking ended before its fixpoint (None: it reached it)."""

    config: MachineConfig
    calls: tuple[Call, ...]
    failure: BaseException  # what the final program raised on its last replay
    replays: int  # candidate programs replayed
    stopped_early: Optional[str] = None


class _Shrinker:
    """The state of one shrink: the best program so far and the replays' budget.

    Invariant kept: ``config`` and ``calls`` always fail with ``signature`` (they are only replaced by a candidate
    whose replay did)."""

    def __init__(
        self,
        journalled: MachineConfig,
        factory: AllocatorFactory,
        signature: Signature,
        safeguards: Safeguards,
        deadline: float,
        stop: Callable[[], bool],
        stats: Optional[RunStats],
    ) -> None:
        self.journalled = journalled  # the configuration the journal's header records
        self.factory = factory  # builds a fresh allocator for every replay
        self.signature = signature  # what every kept candidate fails with
        self.safeguards = safeguards  # the worker's watchdog and journal
        self.deadline = deadline  # perf_counter time the shrink must end by
        self.stop = stop  # the campaign asks the shrink to end now
        self.stats = stats  # counts the replays' steps
        self.replays = 0

    def out_of_time(self) -> bool:
        return time.perf_counter() >= self.deadline or self.stop()

    def fails(self, config: MachineConfig, calls: Sequence[Call]) -> Optional[BaseException]:
        """The failure of this candidate if it has the signature; None otherwise."""
        self.replays += 1
        safeguards = self.safeguards
        if config != self.journalled:  # the journal's header names the first pool: a death here would misreport it
            safeguards = Safeguards(None, safeguards.watchdog)
        try:
            outcome = replay(Target(self.factory, config, self.stats, safeguards), calls)
        except NotApplicable:
            return None
        if outcome.failure is None:
            return None
        found = signature_of(self.signature.allocator, outcome.failure, calls, outcome.failed_at)
        return outcome.failure if found == self.signature else None


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
) -> Shrunk:
    """Shrink ``calls`` under ``config`` (which fail with ``signature``) to a fixpoint of every pass, within
    ``seconds``; never below ``min_blocks`` device blocks, and only to block sizes in ``block_sizes``."""
    shrinker = _Shrinker(config, factory, signature, safeguards, time.perf_counter() + seconds, stop, stats)
    best: tuple[MachineConfig, tuple[Call, ...], BaseException] = (config, tuple(calls), failure)
    # The first passes run to their fixpoint before the others are tried: those move a program from one fixpoint
    # of the first to another, and never lengthen it, so a shrink never ends longer than the first passes alone.
    stages = (
        (_delete_calls, _simplify_arguments, _simplify_shared_values, _renumber, _simplify_config),
        (_merge_calls, _smaller_pool_fewer_calls),
    )
    while True:
        before = best[:2]
        for stage in stages:
            for shrink_pass in stage:
                if shrinker.out_of_time():
                    why = "the campaign ended" if stop() else f"its time bound ({seconds:g} s) ran out"
                    return Shrunk(best[0], best[1], best[2], shrinker.replays, f"shrinking stopped early: {why}")
                best = shrink_pass(shrinker, best, min_blocks, tuple(block_sizes))
            if best[:2] != before:
                break
        if best[:2] == before:
            return Shrunk(best[0], best[1], best[2], shrinker.replays)


_Best = tuple[MachineConfig, tuple[Call, ...], BaseException]


def _delete_calls(shrinker: _Shrinker, best: _Best, min_blocks: int, block_sizes: tuple[int, ...]) -> _Best:
    """Delta debugging: chunks of halving size, then every window of two or three neighbouring calls (a preempt
    and its readmit go together), then every sequence's calls at once (an admit and everything naming it), then
    distant pairs of calls naming one sequence."""
    config, calls, failure = best
    current = list(calls)
    chunk = max(1, len(current) // 2)
    while chunk >= 1 and not shrinker.out_of_time():
        start, deleted = 0, False
        while start < len(current) and not shrinker.out_of_time():
            candidate = current[:start] + current[start + chunk :]
            found = shrinker.fails(config, candidate) if candidate else None
            if found is not None:
                current, failure, deleted = candidate, found, True
            else:
                start += chunk
        if not deleted:
            chunk //= 2
    for width in (2, 3):
        start = 0
        while start + width <= len(current) and not shrinker.out_of_time():
            candidate = current[:start] + current[start + width :]
            found = shrinker.fails(config, candidate) if candidate else None
            if found is not None:
                current, failure = candidate, found
            else:
                start += 1
    for seq in sorted({name for call in current for name in _sequences(call)}):
        if shrinker.out_of_time():
            break
        candidate = [call for call in current if seq not in _sequences(call)]
        found = shrinker.fails(config, candidate) if candidate and len(candidate) < len(current) else None
        if found is not None:
            current, failure = candidate, found
    current, failure = _delete_distant_pairs(shrinker, config, current, failure)
    return config, tuple(current), failure


def _delete_distant_pairs(
    shrinker: _Shrinker, config: MachineConfig, calls: list[Call], failure: BaseException
) -> tuple[list[Call], BaseException]:
    """Every pair of calls naming one sequence, three or more calls apart (a preempt and its readmit with other
    work between them, an admission and the free that undoes it); closer pairs are the windows' job."""
    current, first = calls, 0
    while first < len(current) and not shrinker.out_of_time():
        names, deleted = _sequences(current[first]), False
        for second in range(first + 3, len(current)):
            if shrinker.out_of_time():
                break
            if names & _sequences(current[second]):
                candidate = current[:first] + current[first + 1 : second] + current[second + 1 :]
                found = shrinker.fails(config, candidate)
                if found is not None:
                    current, failure, deleted = candidate, found, True
                    break
        if not deleted:
            first += 1
    return current, failure


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
                current, failure = candidate, found
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
                    found = shrinker.fails(config, trial)
                    if found is not None:
                        current, failure, improved = trial, found, True
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
            found = shrinker.fails(config, trial)
            if found is not None:
                current, failure = trial, found
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
    return (config, tuple(candidate), found) if found is not None else best


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
                options = sorted({v for v in (lowest, value // 2, value - 1) if lowest <= v < value})
            for smaller in options:
                trial = attrs.evolve(config, **cast(dict[str, Any], {name: smaller}))
                found = shrinker.fails(trial, calls)
                if found is not None:
                    config, failure, improved = trial, found, True
                    break
    return config, calls, failure


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
                    return trial, candidate, found
    return best
