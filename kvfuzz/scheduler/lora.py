"""LoRA adapters in the scheduler target (``SchedulerSetup.max_loras``): vLLM's ``lora_config.max_loras``, and
requests drawn with one of :func:`lora_adapters` adapters or none. The scheduler never loads an adapter: it reads a
request's ``lora_request`` (its int id, name and path) for two things, both checked here and by the worker:

* **the prefix cache's namespace**: vLLM folds the adapter's name and path into every block's hash
  (``_gen_lora_extra_hash_keys``), so that a block computed under one adapter is never handed to a request of
  another, nor to one without an adapter. The worker's K/V of a request is a function of its adapter
  (:func:`lora_namespace`), its cache salt and its tokens, so a hit across adapters fails the content check (or
  exclusive writes); a request without an adapter keeps the K/V it always had;
* **the step's adapter limit** (:func:`check_loras`): the distinct adapters of the requests a step schedules never
  exceed ``max_loras`` (the model runner has that many adapter slots; vLLM's scheduler admits a waiting request of a
  new adapter only while fewer are running), and each scheduled request runs under the adapter its client asked
  for, as the output told the model runner (``NewRequestData.lora_request``).

An adapter is named by its int id (1 .. ``max_loras + 1``): ``lora<id>``, with a path of the same name (vLLM asks for
one; nothing is read from it)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvfuzz.scheduler.violations import Check, SchedulerViolation

LORA_KEY = "lora"
"""The first entry of a LoRA's part of a K/V namespace (the adapter's name follows it)."""


def lora_adapters(max_loras: int) -> int:
    """How many adapters requests are drawn from under ``max_loras``: one more, so that the limit can bite (none
    without LoRA)."""
    return max_loras + 1 if max_loras else 0


def lora_name(lora: int) -> str:
    """The name (and path) of adapter ``lora`` (an id from 1)."""
    return f"lora{lora}"


def lora_namespace(lora: int) -> tuple[str, ...]:
    """The LoRA's part of a request's K/V namespace: none without an adapter (``lora`` 0), so that the request's K/V is
    what it was before LoRA existed; the adapter's name otherwise."""
    return (LORA_KEY, lora_name(lora)) if lora else ()


def lora_id(lora_request: Any) -> int:
    """The int id of a vLLM ``LoRARequest``, or 0 for none."""
    return int(lora_request.lora_int_id) if lora_request is not None else 0


def check_loras(
    scheduled: Iterable[str], adapters: Mapping[str, int], asked: Mapping[str, int], max_loras: int, step: int
) -> None:
    """The LoRA check of one step: the distinct adapters among the ``scheduled`` requests (each one's adapter as the
    scheduler's output gave it to the model runner, ``adapters``; 0 for none) are at most ``max_loras``, and each is
    the adapter its client asked for (``asked``)."""
    scheduled = list(scheduled)
    for request in scheduled:
        given, wanted = adapters.get(request, 0), asked.get(request, 0)
        if given != wanted:
            raise SchedulerViolation(
                Check.LORA,
                step,
                request,
                f"the model runner is told to run it under {describe_adapter(given)}, but its client asked for "
                f"{describe_adapter(wanted)}",
                "a request run under another adapter",
            )
    used: dict[int, list[str]] = {}
    for request in scheduled:
        if adapters.get(request, 0):
            used.setdefault(adapters[request], []).append(request)
    if len(used) > max_loras:
        listed = "; ".join(f"{lora_name(lora)}: {', '.join(requests)}" for lora, requests in sorted(used.items()))
        raise SchedulerViolation(
            Check.LORA,
            step,
            used[max(used)][0],
            f"the step schedules requests of {len(used)} distinct LoRA adapters ({listed}), but max_loras is "
            f"{max_loras}",
            "more adapters in a step than max_loras",
        )


def describe_adapter(lora: int) -> str:
    """``LoRA adapter lora2``, or ``no LoRA adapter``, for messages."""
    return f"LoRA adapter {lora_name(lora)}" if lora else "no LoRA adapter"


def limit_held_back(scheduler: Any, max_loras: int) -> bool:
    """Whether vLLM's adapter limit holds a waiting request back after a ``schedule()``: its running requests use
    ``max_loras`` distinct adapters, a waiting request needs another, and the running-request cap has room (the
    token budget or the pool may hold it back too)."""
    if not max_loras or len(scheduler.running) >= scheduler.max_num_running_reqs:
        return False
    running = {lora_id(request.lora_request) for request in scheduler.running} - {0}
    if len(running) < max_loras:
        return False
    return any(lora_id(request.lora_request) not in running | {0} for request in scheduler.waiting)
