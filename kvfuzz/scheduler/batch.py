"""The step's batch as the model runner receives it, checked before the worker executes it: every request the
``SchedulerOutput`` schedules tokens for is one the model runner can execute.

Invariants (checked in this order, each failure naming the request):

* the requests ``num_scheduled_tokens`` names are exactly those the output brings as new or cached requests, each
  once: a request scheduled without its request data has no table on the model runner's side (it would index a
  block table row it does not have), and one brought without scheduled tokens is not in the batch;
* no request the output schedules as running (cached, not resumed) is one the same output preempts or finishes,
  and the model runner holds it, not preempted (its table is the one the scheduler extends);
* ``total_num_scheduled_tokens`` is the sum of the requests' scheduled tokens;
* once the tables are updated, each scheduled request's table covers every position the step schedules for it:
  ``computed + scheduled <= len(table) * block_size`` (an out-of-range block table is what the model runner's slot
  mapping would trip on)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kvfuzz.scheduler.violations import Check, SchedulerViolation
from kvfuzz.scheduler.vllm_release import vllm_release


def check_batch(output: Any, live: Collection[str], step: int) -> None:
    """Raise :class:`SchedulerViolation` where ``output`` schedules a request the model runner cannot execute;
    ``live`` is the requests the worker holds, not preempted, before it reads ``output``."""
    cached = output.scheduled_cached_reqs
    new = [request.req_id for request in output.scheduled_new_reqs]
    brought = new + list(cached.req_ids)
    scheduled = output.num_scheduled_tokens
    preempted = set(output.preempted_req_ids or ())
    finished = set(output.finished_req_ids)
    for request, count in scheduled.items():
        if request not in brought:
            also = " (the same output preempts it)" if request in preempted else ""
            raise SchedulerViolation(
                Check.BATCH,
                step,
                request,
                f"the step schedules {count} token(s) for it{also}, but the output brings it neither as a new nor "
                f"as a cached request, so the model runner has no table for it; new {new}, cached "
                f"{list(cached.req_ids)}",
                "a request scheduled but not brought" + (" (preempted by the same output)" if also else ""),
            )
    for request in brought:
        if brought.count(request) > 1:
            raise SchedulerViolation(
                Check.BATCH, step, request, f"the output brings it more than once: {brought}", "a request brought twice"
            )
        if request not in scheduled:
            raise SchedulerViolation(
                Check.BATCH,
                step,
                request,
                "the output brings it as a scheduled request, with no tokens scheduled",
                "a request brought with no tokens scheduled",
            )
    resumed = vllm_release().resumed(cached)
    for request in cached.req_ids:
        if request in resumed:
            continue
        if request in preempted or request in finished:
            why = "preempts" if request in preempted else "finishes"
            raise SchedulerViolation(
                Check.BATCH,
                step,
                request,
                f"the output schedules it as a running request for {scheduled[request]} token(s), and the same "
                f"output {why} it (preempted {sorted(preempted)})",
                f"a running request the same output {why}",
            )
        if request not in live:
            raise SchedulerViolation(
                Check.BATCH,
                step,
                request,
                f"the output schedules it as a running request for {scheduled[request]} token(s), but the model "
                "runner holds no running state for it (never admitted, finished, or preempted and not resumed)",
                "a running request the model runner does not hold",
            )
    total = sum(scheduled.values())
    if output.total_num_scheduled_tokens != total:
        raise SchedulerViolation(
            Check.BATCH,
            step,
            None,
            f"total_num_scheduled_tokens is {output.total_num_scheduled_tokens}, but the requests' scheduled tokens "
            f"sum to {total}: {dict(scheduled)}",
            "the total of scheduled tokens",
        )


def check_table_covers(request: str, table: list[int], computed: int, count: int, block_size: int, step: int) -> None:
    """Raise :class:`SchedulerViolation` unless ``table`` covers positions ``computed .. computed + count - 1``."""
    end = computed + count
    if end > len(table) * block_size:
        raise SchedulerViolation(
            Check.BATCH,
            step,
            request,
            f"the step schedules its positions {computed}..{end - 1}, but its block table of {len(table)} "
            f"block(s) {table} covers positions 0..{len(table) * block_size - 1} only",
            "a table too short for the scheduled positions",
        )
