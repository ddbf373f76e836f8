"""Shrinking passes that simplify what the calls say: shorter token lists, zero token values, smaller integers, a
value several calls share simplified in all of them, sequence ids renumbered in order of first use."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from kvfuzz.engine.misuse import MisuseCall
from kvfuzz.program.call import Call
from kvfuzz.shrink.candidates import SEQ_ARGUMENTS, SEQ_ID, Best, Shrinker


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


def simplify_arguments(shrinker: Shrinker, best: Best) -> Best:
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


def simplify_shared_values(shrinker: Shrinker, best: Best) -> Best:
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
        return SEQ_ID.sub(lambda match: names.setdefault(match.group(0), f"s{len(names)}"), text)

    def value_of(name: str, value: Any) -> Any:
        if name in SEQ_ARGUMENTS and isinstance(value, str):
            return rename(value)
        if isinstance(value, MisuseCall):
            args = tuple(rename(item) if isinstance(item, str) else item for item in value.args)
            return MisuseCall(value.op, args, rename(value.why))
        return value

    return [Call(call.rule, {name: value_of(name, value) for name, value in call.arguments}) for call in calls]


def renumber(shrinker: Shrinker, best: Best) -> Best:
    config, calls, failure = best
    candidate = renumbered(calls)
    if candidate == list(calls):
        return best
    found = shrinker.fails(config, candidate)
    return (config, found.calls, found.failure) if found is not None else best
