"""New allocator programs from kept ones (a guided campaign's seeds, :mod:`kvfuzz.campaign.feedback`): programs are
data, so a call is inserted, deleted, duplicated or moved, two programs are spliced, or a call's arguments are drawn
afresh.

A mutant is a list of :data:`Gene`: a :class:`~kvfuzz.program.call.Call` kept from a seed, or a :class:`Fresh` call
drawn where it stands. Calls name sequences and blocks by the ids the calls before them made, so a mutation strands
some (a grow of a sequence whose admission was deleted): :func:`run_mutant` skips a kept call the state before it
cannot take (:meth:`~kvfuzz.program.execution.Execution.accepts`, the replay's own test), as a shrinker's candidate
skips its stranded calls, and draws each fresh call from the operations enabled there. What it ran is an ordinary
program: its calls are the execution's, so a failure prints, shrinks, saves and replays like a random program's.
"""

from __future__ import annotations

import random
from typing import Callable, Optional, Sequence

import attrs

from kvfuzz.engine.operation import Operation
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Execution, Target
from kvfuzz.program.random_programs import CallDraws, RandomFailure, run_program


@attrs.frozen
class Fresh:
    """A call drawn afresh where it stands: of ``operation`` when that is enabled there (a call's arguments
    changed), else of any enabled operation (a call inserted; ``operation`` None)."""

    operation: Optional[str] = None


Gene = Call | Fresh
"""One place of a mutant: a seed's call, or a call drawn when the mutant reaches it."""

MAX_GENES = 1000
"""A mutant longer than this is cut (duplications and splices compound): a seed is at most a campaign's program."""


def mutate(program: Sequence[Call], rng: random.Random, other: Sequence[Call] = ()) -> tuple[Gene, ...]:
    """One to three mutations of ``program`` (``other``, a second seed of its configuration, is what a splice takes
    its tail from). Never empty: an empty result is one fresh call."""
    mutated: list[Gene] = list(program)
    for _ in range(rng.randint(1, 3)):
        mutated = rng.choice(MUTATIONS)(mutated, rng, other)
    return tuple(mutated[:MAX_GENES]) or (Fresh(),)


Mutation = Callable[[list[Gene], random.Random, Sequence[Call]], list[Gene]]


def _insert(genes: list[Gene], rng: random.Random, other: Sequence[Call]) -> list[Gene]:
    """A fresh call of any operation enabled there, at a random place."""
    index = rng.randint(0, len(genes))
    return [*genes[:index], Fresh(), *genes[index:]]


def _delete(genes: list[Gene], rng: random.Random, other: Sequence[Call]) -> list[Gene]:
    """A run of up to four calls deleted."""
    if not genes:
        return genes
    start = rng.randrange(len(genes))
    return genes[:start] + genes[start + rng.randint(1, 4) :]


def _duplicate(genes: list[Gene], rng: random.Random, other: Sequence[Call]) -> list[Gene]:
    """A run of up to eight calls repeated right after itself (more load of the same shape: its repeated admissions
    become fresh ones, since a sequence id is admitted once)."""
    if not genes:
        return genes
    start = rng.randrange(len(genes))
    end = min(len(genes), start + rng.randint(1, 8))
    repeated = [
        Fresh(gene.rule) if isinstance(gene, Call) and gene.rule == "admit" else gene for gene in genes[start:end]
    ]
    return genes[:end] + repeated + genes[end:]


def _move(genes: list[Gene], rng: random.Random, other: Sequence[Call]) -> list[Gene]:
    if len(genes) < 2:
        return genes
    moved = genes[:]
    gene = moved.pop(rng.randrange(len(moved)))
    moved.insert(rng.randint(0, len(moved)), gene)
    return moved


def _splice(genes: list[Gene], rng: random.Random, other: Sequence[Call]) -> list[Gene]:
    """The head of this program, then the tail of ``other``."""
    if not other:
        return _insert(genes, rng, other)
    return genes[: rng.randint(0, len(genes))] + list(other[rng.randrange(len(other)) :])


def _redraw(genes: list[Gene], rng: random.Random, other: Sequence[Call]) -> list[Gene]:
    """A call's arguments drawn afresh (its operation kept where it is enabled)."""
    if not genes:
        return _insert(genes, rng, other)
    index = rng.randrange(len(genes))
    gene = genes[index]
    return [*genes[:index], Fresh(gene.rule if isinstance(gene, Call) else gene.operation), *genes[index + 1 :]]


MUTATIONS: tuple[Mutation, ...] = (_insert, _delete, _duplicate, _move, _splice, _redraw)


def run_mutant(
    target: Target, rng: random.Random, genes: Sequence[Gene], operations: Sequence[Operation]
) -> Optional[RandomFailure]:
    """Run the mutant ``genes`` on a fresh allocator, then the teardown: each kept call the state can take, each
    fresh one drawn from ``operations`` (see the module); the failure, if it fails (its calls: those made)."""

    def calls(execution: Execution) -> None:
        draws = CallDraws(execution, operations)
        names = {operation.name for operation in operations}
        for gene in genes:
            if isinstance(gene, Fresh):
                drawn = draws.draw(rng, gene.operation)
                if drawn is not None:
                    execution.execute(*drawn)
            elif gene.rule in names and execution.accepts(gene):
                execution.execute(gene.rule, gene.kwargs())

    return run_program(target, calls)
