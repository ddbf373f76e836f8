"""Shrinking passes over the configuration: fewer device blocks, fewer host blocks, a smaller block size (the
program's prompts and token lists rewritten to keep their roles), a smaller W (when the campaign chose W); and a
smaller pool (or W) and one call fewer together, where neither goes alone (a program building pool pressure)."""

from __future__ import annotations

from typing import Any, cast

import attrs

from kvfuzz.engine.arguments import system_prompts
from kvfuzz.program.call import Call
from kvfuzz.shrink.candidates import Best, PoolShrinker


def simplify_config(shrinker: PoolShrinker, best: Best) -> Best:
    config, calls, failure = best
    fields = [("num_blocks", shrinker.pools.min_blocks), ("num_host_blocks", 0), ("block_size", 1)]
    if config.inflight_window is not None:  # a W the campaign asked for (the factory builds any): a smaller one
        fields.append(("inflight_window", 0))
    for name, lowest in fields:
        improved = True
        while improved and not shrinker.out_of_time():
            improved = False
            value = getattr(config, name)
            if name == "block_size" and shrinker.pools.block_sizes:
                options = sorted(size for size in shrinker.pools.block_sizes if size < value)
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
    (:func:`~kvfuzz.engine.arguments.system_prompts`), so each becomes the new size's prompt of the same role. Token
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


def smaller_pool_fewer_calls(shrinker: PoolShrinker, best: Best) -> Best:
    """A smaller pool (fewer device blocks, or a smaller W the campaign chose) together with one call fewer, for
    programs that build pool pressure or age blocks through the in-flight window: there, a smaller pool alone
    changes when a refusal comes and deleting any one call alone undoes the pressure, while both together keep the
    failure. The first pair that still fails is kept (the passes then run again)."""
    config, calls, failure = best
    fields = [("num_blocks", shrinker.pools.min_blocks)]
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
