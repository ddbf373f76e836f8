"""Shrinking passes that delete or merge calls.

* delete calls: chunks of halving size down to single calls (delta debugging; with a chunk go the later calls of
  the sequences it admitted or forked), every window of two or three neighbouring calls, all the calls that name one
  sequence;
* delete every pair of distant calls naming one sequence (replays quadratic in the length);
* merge calls: a grow and the next grow of its sequence into one grow, an admit and the grow after it into an admit
  with the longer suffix (within the operations' bounds), a decode into a step.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

from kvfuzz.program.call import Call
from kvfuzz.shrink.candidates import Best, Shrinker, sequences
from kvfuzz.shrink.deletion import delete_operations


def delete_calls(shrinker: Shrinker, best: Best) -> Best:
    """Delta debugging (:func:`~kvfuzz.shrink.deletion.delete_operations`): chunks of halving size (each with the
    later calls of the sequences it brought in), then every window of two or three neighbouring calls (a preempt and
    its readmit go together), then every sequence's calls at once (an admit and everything naming it). Each costs a
    number of replays about linear in the program's length; distant pairs, quadratic, are a later pass."""
    calls = _Calls(shrinker, best)
    kept = delete_operations(best[1], calls, shrinker.out_of_time)
    return calls.config, tuple(kept), calls.failure


class _Calls:
    """An allocator's program as the deletion pass sees it (:class:`~kvfuzz.shrink.deletion.Deletable`): a candidate
    judged by the shrinker in the configuration kept last (which a candidate may change: a smaller pool), and the
    configuration and failure of the program kept last."""

    def __init__(self, shrinker: Shrinker, best: Best) -> None:
        self.shrinker = shrinker
        self.config, _, self.failure = best

    def fails(self, candidate: list[Call]) -> Optional[list[Call]]:
        found = self.shrinker.fails_shorter(self.config, candidate)
        if found is None:
            return None
        self.config, self.failure = found.config, found.failure
        return list(found.calls)

    def without(self, program: list[Call], start: int, end: int) -> list[Call]:
        return _without_chunk(program, start, end)

    def names(self, program: Sequence[Call]) -> list[str]:
        return sorted({name for call in program for name in sequences(call)})

    def without_name(self, program: list[Call], name: str) -> list[Call]:
        return [call for call in program if name not in sequences(call)]


def _without_chunk(calls: list[Call], start: int, end: int) -> list[Call]:
    """``calls`` less those from ``start`` to ``end`` and every later call naming a sequence one of those brought
    in (admitted, or forked as a child), transitively: without its admission such a call could not be made, so a
    chunk deleted alone would leave a program that cannot be replayed."""
    born = {name for call in calls[start:end] for name in _introduced(call)}
    kept = calls[:start]
    for call in calls[end:]:
        if sequences(call) & born:
            born.update(_introduced(call))
        else:
            kept.append(call)
    return kept


def _introduced(call: Call) -> set[str]:
    """The sequence a call brings in: an admission's, a fork's child."""
    argument = {"admit": "seq", "fork": "child"}.get(call.rule)
    name = None if argument is None else call.kwargs().get(argument)
    return {name} if isinstance(name, str) else set()


def delete_distant_pairs(shrinker: Shrinker, best: Best) -> Best:
    """Every pair of calls naming one sequence, three or more calls apart (a preempt and its readmit with other
    work between them, an admission and the free that undoes it); closer pairs are the windows' job. Its replays
    grow with the square of the program's length, so it runs once the linear passes have reached their fixpoint
    (on a long program in a large pool it would otherwise spend the time bound before the pool gets smaller)."""
    config, calls, failure = best
    current, first = list(calls), 0
    while first < len(current) and not shrinker.out_of_time():
        names, deleted = sequences(current[first]), False
        for second in range(first + 3, len(current)):
            if shrinker.out_of_time():
                break
            if names & sequences(current[second]):
                candidate = current[:first] + current[first + 1 : second] + current[second + 1 :]
                found = shrinker.fails_shorter(config, candidate)
                if found is not None:
                    config, current, failure, deleted = found.config, list(found.calls), found.failure, True
                    break
        if not deleted:
            first += 1
    return config, tuple(current), failure


def merge_calls(shrinker: Shrinker, best: Best) -> Best:
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
    """The candidates :func:`merge_calls` tries for the call at ``index``, each a whole program."""
    call = calls[index]
    before, after = calls[:index], calls[index + 1 :]
    if call.rule == "decode":
        yield before + [Call("step", {})] + after
        return
    if call.rule not in ("admit", "grow"):
        return
    seq = call.kwargs()["seq"]
    later = next((position for position, other in enumerate(after) if seq in sequences(other)), None)
    if later is None or after[later].rule != "grow":
        return
    field = "suffix" if call.rule == "admit" else "tokens"
    merged = Call(call.rule, {**call.kwargs(), field: [*call.kwargs()[field], *after[later].kwargs()["tokens"]]})
    between, rest = after[:later], after[later + 1 :]
    yield before + [merged] + between + rest
    if between:
        yield before + between + [merged] + rest
