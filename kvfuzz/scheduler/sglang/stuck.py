"""What a hang of the SGLang target's progress check is: the request SGLang's loop is stuck on, and why, in words that
do not depend on the example, so that a campaign keys two hangs apart (SGLang's known hangs, the ignore_eos clip and
the page overhead, were one signature before) and the same hang met twice together.

The request stuck is the one the loop would take first: the chunked prefill if one is left, else the head of the
waiting queue (every other request waits behind it), else a running request. Why is the last admission loop's word
on it (the ``PrefillAdder``'s verdict, or the batch full or the step's budget spent before it was asked), the
admission path its request takes (``ignore_eos`` without the radix cache is ``add_one_req_ignore_eos``'s), and
whether the radix cache is on."""

from __future__ import annotations

from typing import Any

from kvfuzz.scheduler.config import SchedulerSetup


def stuck_cause(base: str, loop: Any, setup: SchedulerSetup, unfinished: list[str]) -> str:
    """``base`` (``a drain step scheduled nothing``, ``the drain ran past its bound``) and what is stuck and why
    (``unfinished``: the requests the client still waits for, in arrival order)."""
    waiting = set(unfinished)
    chunked = loop.chunked_req
    if chunked is not None and chunked.rid in waiting:
        return f"{base}: a chunked prefill never continued ({_path(chunked, setup)})"
    head = next((req for req in loop.waiting_queue if req.rid in waiting), None)
    if head is not None:
        refused = loop.refusals.get(head.rid, "never reached by an admission loop")
        return f"{base}: a waiting request never admitted ({refused}; {_path(head, setup)})"
    if any(req.rid in waiting for req in loop.running_batch.reqs):
        return f"{base}: a running request never scheduled"
    return f"{base}: a request the loop no longer holds"


def _path(req: Any, setup: SchedulerSetup) -> str:
    """The admission path ``req`` takes: ``add_one_req`` against the radix cache or without it, or, for an
    ``ignore_eos`` request without the radix cache, ``add_one_req_ignore_eos``."""
    if setup.prefix_caching:
        return "the radix cache"
    return "ignore_eos admission, no radix cache" if req.sampling_params.ignore_eos else "no radix cache"
