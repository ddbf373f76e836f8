"""What a failed check of the scheduler target reports: the check, the step, the request, what was expected and what
was found."""

from __future__ import annotations

import enum
from typing import Optional


class Check(enum.Enum):
    """The checks kvfuzz runs on the real scheduler (docs/scheduler.md)."""

    CONTENT = "content"  # every position a scheduled token attends to holds its own request's K/V
    EXCLUSIVE = "exclusive"  # no write gives a slot content other than what a live request or this step needs there
    OUTPUTS = "outputs"  # every request's output is exactly the tokens the fake model sampled for it, in order
    ACCOUNTING = "accounting"  # the manager's free blocks and refcounts agree with the worker's tables
    PROGRESS = "progress"  # once arrivals stop, every request finishes within a bound
    SPECULATIVE = "speculative"  # drafts scheduled as proposed, and rejected ones rolled back
    HANG = "hang"  # a step (``schedule()``, the worker, ``update_from_output()``) returns within the call timeout
    SLOT_MAPPING = "slot-mapping"  # the engine's own slot mapping writes each token where the tables say
    ATTENTION = "attention"  # attention through the tables equals the reference's over the request's own K/V
    BATCH = "batch"  # every request a step schedules is one the model runner can execute, its table covering it
    RELEASED = "released"  # under async scheduling: a released block is not written before the steps reading it ran
    LORA = "lora"  # a step's distinct LoRA adapters at most max_loras, each request under the adapter it asked for
    TRANSFER = "transfer"  # a KV connector's store or load in flight: its blocks not written (nor, loads, read)
    PREFIX_RESET = "prefix-reset"  # reset_prefix_cache refuses while blocks are in use, and leaves nothing cached
    KV_EVENTS = "kv-events"  # the KV cache events announce every cached block once, with its hash and parent
    ORDER = "order"  # the policy's victims and admission order (docs/oracles.md)
    BUDGET = "budget"  # each step within the token budgets, the running cap and max_model_len (docs/oracles.md)
    LIVENESS = "liveness"  # no request left unserved while the step left it room (docs/oracles.md)
    STATS = "stats"  # the scheduler stats agree with the pool and the requests (kvfuzz.scheduler.stats)
    # a prefix-cache hit ends on a prefix-hash boundary, before the request's last token (and, under an EAGLE head,
    # holds draft K/V for the request's own next token)
    PREFIX_HIT = "prefix-hit"
    SESSIONS = "sessions"  # a streaming session keeps its tokens and their hashes, and is not scheduled while paused
    DELAYED_FREE = "delayed-free"  # a block a connector's send or a deferred free holds stays out of the pool
    PAUSE = "pause"  # a paused scheduler starts no new request, and schedules nothing when paused to keep


class SchedulerViolation(Exception):
    """A check failed. The message names the check, the step (the number of ``schedule()`` calls so far) and the
    request, then says what was expected and what was found. ``cause`` is what the check knows of why, in a few
    words that do not depend on the example (the block, the request and the step do not appear in it), where it
    knows one: a campaign's signature tells two failures of one check apart by it."""

    def __init__(
        self, check: Check, step: int, request: Optional[str], detail: str, cause: Optional[str] = None
    ) -> None:
        self.check = check  # which check failed
        self.step = step  # the step it failed at
        self.request = request  # the request it concerns, if one
        self.detail = detail  # expected vs found
        self.cause = cause  # why, where the check knows: "a held block's ref_cnt", "a drain step scheduled nothing"
        about = f", request {request}" if request is not None else ""
        super().__init__(f"{check.value} check failed at step {step}{about}: {detail}")

    def __reduce__(self) -> tuple[type, tuple[Check, int, Optional[str], str, Optional[str]]]:
        """Pickled with its fields (an isolated batch sends its failure to the campaign)."""
        return (SchedulerViolation, (self.check, self.step, self.request, self.detail, self.cause))
