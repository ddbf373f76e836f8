"""New scheduler programs from kept ones (a guided campaign's seeds): programs are data, so an operation is inserted,
deleted, duplicated or moved, two programs are spliced, or an operation's arguments change.

Invariant: every program :func:`mutate` returns is valid for its configuration as a trace holds it
(:func:`kvfuzz.scheduler.trace.from_json` accepts it): aborts name requests added before them, prompts and
``max_tokens`` stay within the model's length, arguments within the configuration's rows (a priority only under the
priority policy, an adapter only with LoRA, a reset only where the configuration draws resets, a resumable request
and a resume only where it draws sessions, a resume naming a request added before it)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Callable

import attrs

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.fake_model import VOCABULARY
from kvfuzz.scheduler.lora import lora_adapters
from kvfuzz.scheduler.machine import SHARED, prefix_lengths
from kvfuzz.scheduler.model_length import overlong_limit
from kvfuzz.scheduler.program import Abort, AddRequest, Operation, Pause, ResetPrefixCache, Resume, Step, Unpause
from kvfuzz.scheduler.trace import LIMITS

Program = tuple[Operation, ...]


def mutate(program: Program, setup: SchedulerSetup, rng: random.Random, other: Program = ()) -> Program:
    """One to three mutations of ``program`` (``other``, a second kept program of the same configuration, is what a
    splice takes its tail from), then repaired to validity (see the module). Never empty: an empty result is one
    request and a step."""
    mutated = list(program)
    for _ in range(rng.randint(1, 3)):
        mutated = rng.choice(MUTATIONS)(mutated, setup, rng, other)
    return repair(mutated, setup)


def _insert(program: list[Operation], setup: SchedulerSetup, rng: random.Random, other: Program) -> list[Operation]:
    index = rng.randint(0, len(program))
    return program[:index] + [fresh(setup, rng, program[:index])] + program[index:]


def _delete(program: list[Operation], setup: SchedulerSetup, rng: random.Random, other: Program) -> list[Operation]:
    if not program:
        return program
    index = rng.randrange(len(program))
    return program[:index] + program[index + 1 :]


def _duplicate(program: list[Operation], setup: SchedulerSetup, rng: random.Random, other: Program) -> list[Operation]:
    """A run of up to four operations repeated right after itself (more load of the same shape)."""
    if not program:
        return program
    start = rng.randrange(len(program))
    end = min(len(program), start + rng.randint(1, 4))
    return program[:end] + program[start:end] + program[end:]


def _move(program: list[Operation], setup: SchedulerSetup, rng: random.Random, other: Program) -> list[Operation]:
    if len(program) < 2:
        return program
    moved = program[:]
    operation = moved.pop(rng.randrange(len(moved)))
    moved.insert(rng.randint(0, len(moved)), operation)
    return moved


def _splice(program: list[Operation], setup: SchedulerSetup, rng: random.Random, other: Program) -> list[Operation]:
    """The head of this program, then the tail of ``other`` (its aborts renumbered past this head's requests)."""
    if not other:
        return _insert(program, setup, rng, other)
    head = program[: rng.randint(0, len(program))]
    tail = list(other[rng.randint(0, len(other) - 1) :])
    added = sum(isinstance(operation, AddRequest) for operation in head)
    skipped = sum(isinstance(operation, AddRequest) for operation in other[: len(other) - len(tail)])
    shifted = [
        Abort(f"r{int(operation.request[1:]) - skipped + added}") if isinstance(operation, Abort) else operation
        for operation in tail
    ]
    return head + shifted


def _change(program: list[Operation], setup: SchedulerSetup, rng: random.Random, other: Program) -> list[Operation]:
    """One operation's arguments changed: a request's prompt (cut, grown, or a shared prefix's start), its
    ``max_tokens``, priority or adapter; a reset's ``preempt``; an abort's request; a resume's request and input."""
    if not program:
        return program
    index = rng.randrange(len(program))
    operation = program[index]
    if isinstance(operation, AddRequest):
        changed: Operation = _change_add(operation, setup, rng)
    elif isinstance(operation, ResetPrefixCache):
        changed = ResetPrefixCache(not operation.preempt and not setup.async_scheduling)
    elif isinstance(operation, Pause):
        changed = Pause(not operation.keep)
    elif isinstance(operation, Abort):
        added = sum(isinstance(earlier, AddRequest) for earlier in program[:index])
        changed = Abort(f"r{rng.randrange(added)}") if added else operation
    elif isinstance(operation, Resume):
        changed = _fresh_resume(setup, rng, sum(isinstance(earlier, AddRequest) for earlier in program[:index]))
    else:
        changed = fresh(setup, rng, program[:index])
    return program[:index] + [changed] + program[index + 1 :]


def _change_add(add: AddRequest, setup: SchedulerSetup, rng: random.Random) -> AddRequest:
    prompt = list(add.prompt)
    what = rng.randrange(5)
    if what == 0:
        prompt = prompt[: rng.randint(1, len(prompt))]
    elif what == 1:
        prompt += [rng.randrange(VOCABULARY) for _ in range(rng.randint(1, 2 * setup.block_size))]
    elif what == 2:
        prompt = list(SHARED[: rng.choice(prefix_lengths(setup)[1:])]) + prompt[-rng.randint(0, len(prompt)) :]
    elif what == 3:
        add = attrs.evolve(add, max_tokens=rng.randint(1, max(1, setup.max_model_len // 2)))
    elif setup.policy == "priority":
        add = attrs.evolve(add, priority=rng.randint(-3, 3))
    elif setup.max_loras:
        add = attrs.evolve(add, lora=rng.randint(0, lora_adapters(setup.max_loras)))
    return attrs.evolve(add, prompt=prompt)


def fresh(setup: SchedulerSetup, rng: random.Random, before: Sequence[Operation]) -> Operation:
    """A new operation: a step, a request (a shared prefix's start and a random suffix), an abort of a request
    added in ``before``, or (where the configuration draws them) a prefix-cache reset or new input to a session."""
    added = sum(isinstance(operation, AddRequest) for operation in before)
    choice = rng.randrange(8)
    if choice < 3:
        return Step()
    if choice == 3 and added:
        return Abort(f"r{rng.randrange(added)}")
    if choice == 4 and setup.prefix_resets:
        return ResetPrefixCache(rng.random() < 0.5 and not setup.async_scheduling)
    if choice == 5 and setup.sessions and added:
        return _fresh_resume(setup, rng, added)
    if choice == 6 and setup.pauses:
        return Pause(rng.random() < 0.5) if rng.random() < 0.5 else Unpause()
    prefix = list(SHARED[: rng.choice(prefix_lengths(setup))])
    suffix = [rng.randrange(VOCABULARY) for _ in range(rng.randint(0, 2 * setup.block_size))]
    length = rng.randint(1, max(2 * setup.block_size, setup.max_model_len // 4))
    return AddRequest(prefix + suffix or [0], length, resumable=setup.sessions and rng.random() < 0.5)


def _fresh_resume(setup: SchedulerSetup, rng: random.Random, added: int) -> Operation:
    """New input (one token to two blocks) to one of the ``added`` requests (a step where none was added)."""
    if not added:
        return Step()
    prompt = [rng.randrange(VOCABULARY) for _ in range(rng.randint(1, 2 * setup.block_size))]
    return Resume(f"r{rng.randrange(added)}", prompt, rng.randint(1, 2 * setup.block_size))


def repair(program: Sequence[Operation], setup: SchedulerSetup) -> Program:
    """``program`` made valid for ``setup`` (see the module): aborts of requests not added before them dropped,
    prompts cut to the model's length and their tokens to the vocabulary, ``max_tokens`` and ``min_tokens`` within
    the room left, arguments the configuration does not draw reset to their defaults, resets dropped where it draws
    none, at most the trace's limit of operations. An empty program becomes one request and a step."""
    repaired: list[Operation] = []
    added = 0
    for operation in program:
        if isinstance(operation, Abort):
            if operation.request[1:].isdigit() and int(operation.request[1:]) < added:
                repaired.append(operation)
        elif isinstance(operation, ResetPrefixCache):
            if setup.prefix_resets:
                repaired.append(ResetPrefixCache(operation.preempt and not setup.async_scheduling))
        elif isinstance(operation, (Pause, Unpause)):
            if setup.pauses:
                repaired.append(operation)
        elif isinstance(operation, Resume):
            if setup.sessions and operation.request[1:].isdigit() and int(operation.request[1:]) < added:
                prompt = [token % VOCABULARY for token in operation.prompt][: setup.max_model_len - 1] or [0]
                max_tokens = max(1, min(operation.max_tokens, setup.max_model_len - len(prompt)))
                repaired.append(Resume(operation.request, prompt, max_tokens))
        elif isinstance(operation, AddRequest):
            prompt = [token % VOCABULARY for token in operation.prompt][: setup.max_model_len - 1] or [0]
            room = (overlong_limit(setup) if setup.overlong_requests else setup.max_model_len) - len(prompt)
            max_tokens = max(1, min(operation.max_tokens, room))
            repaired.append(
                attrs.evolve(
                    operation,
                    prompt=prompt,
                    max_tokens=max_tokens,
                    priority=operation.priority if setup.policy == "priority" else 0,
                    lora=min(operation.lora, lora_adapters(setup.max_loras)) if setup.max_loras else 0,
                    min_tokens=min(operation.min_tokens, max_tokens),
                    cache_salt=operation.cache_salt if setup.cache_salts else None,
                    stop_token_ids=operation.stop_token_ids if setup.stop_tokens else (),
                    eos=operation.eos and setup.eos,
                    resumable=operation.resumable and setup.sessions,
                )
            )
            added += 1
        else:
            repaired.append(operation)
    repaired = repaired[: LIMITS["program"]]
    return tuple(repaired) or (fresh_request(setup), Step())


def fresh_request(setup: SchedulerSetup) -> AddRequest:
    """The smallest request: one token, one output."""
    return AddRequest([0], 1)


Mutation = Callable[[list[Operation], SchedulerSetup, random.Random, Program], list[Operation]]
MUTATIONS: tuple[Mutation, ...] = (_insert, _delete, _duplicate, _move, _splice, _change)
"""Every mutation, each drawn alike."""
