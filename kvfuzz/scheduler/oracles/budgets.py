"""The budget check: each step within what the engine's configuration allows (``Check.BUDGET``).

Of every step (``schedule()``'s output, as the model runner reads it):

* its scheduled tokens, drafts included, are at most ``max_num_scheduled_tokens`` (vLLM's ``SchedulerConfig``;
  ``max_num_batched_tokens`` where the configuration leaves it unset);
* its scheduled tokens plus ``max_num_new_slots_for_drafting`` per scheduled request (the slots a parallel drafter
  appends to each request's input; 0 without one) are at most ``max_num_batched_tokens``;
* it schedules at most ``max_num_seqs`` requests, and at most ``max_num_seqs`` requests are running after it (the
  model runner has that many request slots);
* no scheduled request grows past ``max_model_len``: the positions it computes and the token it samples after them
  stay below it (computed before the step + scheduled <= ``max_model_len - 1``);
* with ``max_num_active_seqs`` (vLLM's admission cap, below ``max_num_seqs``), at most that many requests are
  running after it;
* with ``long_prefill_token_threshold`` ``T``, a step that schedules several requests gives none more than ``T``
  tokens (vLLM lifts the cap only for a request alone in the engine); with
  ``long_prefill_token_threshold_adaptive`` the cap is floored at the budget's fair share,
  ``max_num_batched_tokens // n`` for the ``n`` requests running or waiting when the step began, so a step that
  schedules ``k`` requests (``k <= n``) gives none more than ``max(T, max_num_batched_tokens // k)``;
* with chunked prefill off (``enable_chunked_prefill=False``), a request the step admits (new, or resumed after a
  preemption) is scheduled every token it has left to compute, drafts aside: its prompt (and, resumed, the outputs
  it replays) beyond its prefix-cache hit, whole, never a first chunk (:func:`check_unsplit`).

The LoRA limit (at most ``max_loras`` adapters a step) is the LoRA check's (:mod:`kvfuzz.scheduler.lora`). The
limits are read from the configuration kvfuzz built, never from the scheduler object, so a scheduler that misreads
its own configuration is held to what it was given."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import attrs

from kvfuzz.scheduler.oracles.events import StepEvents
from kvfuzz.scheduler.violations import Check, SchedulerViolation


@attrs.frozen
class Budgets:
    """The limits one configuration sets on every step."""

    max_num_batched_tokens: int
    max_num_scheduled_tokens: int
    max_num_seqs: int
    max_model_len: int
    draft_slots: int  # max_num_new_slots_for_drafting: input slots a request's drafts take beyond its tokens
    max_num_active_seqs: int  # requests admitted to run at most: vLLM's max_num_active_seqs, else max_num_seqs
    long_prefill_token_threshold: int  # a request's tokens a step beside others (0: no cap)
    long_prefill_token_threshold_adaptive: bool  # that cap floored at the budget's fair share
    chunked_prefill: bool = True  # vLLM's enable_chunked_prefill: off, a request is admitted with all it has left

    @classmethod
    def of(cls, config: Any) -> "Budgets":
        """The limits of a ``VllmConfig``."""
        scheduler = config.scheduler_config
        scheduled = getattr(scheduler, "max_num_scheduled_tokens", None)
        spec = config.speculative_config
        return cls(
            scheduler.max_num_batched_tokens,
            scheduled if scheduled is not None else scheduler.max_num_batched_tokens,
            scheduler.max_num_seqs,
            config.model_config.max_model_len,
            int(getattr(spec, "max_num_new_slots_for_drafting", 0) or 0) if spec is not None else 0,
            scheduler.max_num_active_seqs or scheduler.max_num_seqs,
            scheduler.long_prefill_token_threshold,
            scheduler.long_prefill_token_threshold_adaptive,
            bool(scheduler.enable_chunked_prefill),
        )

    @property
    def running_cap(self) -> str:
        """The running cap's name and value, for a person."""
        if self.max_num_active_seqs != self.max_num_seqs:
            return f"max_num_active_seqs {self.max_num_active_seqs}"
        return f"max_num_seqs {self.max_num_seqs}"

    def per_request_cap(self, scheduled: int) -> Optional[int]:
        """The most tokens a step that schedules ``scheduled`` requests may give one of them (None: no cap)."""
        threshold = self.long_prefill_token_threshold
        if not threshold or scheduled < 2:
            return None
        if self.long_prefill_token_threshold_adaptive:
            return max(threshold, self.max_num_batched_tokens // scheduled)
        return threshold

    def input_tokens(self, events: StepEvents) -> int:
        """The step's input slots: its scheduled tokens and each scheduled request's draft slots."""
        return events.total + self.draft_slots * len(events.scheduled)


def check_budgets(budgets: Budgets, events: StepEvents, running: Sequence[str]) -> None:
    """Raise :class:`SchedulerViolation` where the step ``events`` breaks a limit of ``budgets`` (``running``: the
    requests running after it, in admission order)."""
    step, scheduled = events.step, events.scheduled
    if events.total > budgets.max_num_scheduled_tokens:
        name = (
            "max_num_scheduled_tokens"
            if budgets.max_num_scheduled_tokens != budgets.max_num_batched_tokens
            else "max_num_batched_tokens"
        )
        raise SchedulerViolation(
            Check.BUDGET,
            step,
            max(scheduled, key=scheduled.__getitem__),
            f"the step schedules {events.total} tokens ({_listed(scheduled)}), but {name} is "
            f"{budgets.max_num_scheduled_tokens}: a step's tokens, drafts included, never exceed it",
            "a step over its token budget",
        )
    slots = budgets.input_tokens(events)
    if slots > budgets.max_num_batched_tokens:
        raise SchedulerViolation(
            Check.BUDGET,
            step,
            max(scheduled, key=scheduled.__getitem__),
            f"the step's input is {slots} slots ({events.total} scheduled tokens ({_listed(scheduled)}) and "
            f"{budgets.draft_slots} draft slot(s) for each of its {len(scheduled)} requests), but "
            f"max_num_batched_tokens is {budgets.max_num_batched_tokens}",
            "a step's input over max_num_batched_tokens",
        )
    for count, what in ((len(scheduled), "schedules"), (len(running), "leaves running")):
        if count > budgets.max_num_seqs:
            names = list(scheduled) if what == "schedules" else list(running)
            raise SchedulerViolation(
                Check.BUDGET,
                step,
                names[-1],
                f"the step {what} {count} requests ({', '.join(names)}), but max_num_seqs is {budgets.max_num_seqs}: "
                "the model runner holds that many requests at most",
                f"a step that {what} more requests than max_num_seqs",
            )
    if len(running) > budgets.max_num_active_seqs:
        raise SchedulerViolation(
            Check.BUDGET,
            step,
            list(running)[-1],
            f"the step leaves {len(running)} requests running ({', '.join(running)}), but max_num_active_seqs is "
            f"{budgets.max_num_active_seqs}: the scheduler admits a waiting request only while fewer run",
            "a step that leaves more requests running than max_num_active_seqs",
        )
    cap = budgets.per_request_cap(len(scheduled))
    over = [request for request, count in scheduled.items() if cap is not None and count > cap]
    if over:
        floor = (
            f", floored at max_num_batched_tokens {budgets.max_num_batched_tokens} // {len(scheduled)} scheduled "
            "requests (adaptive)"
            if budgets.long_prefill_token_threshold_adaptive
            else ""
        )
        raise SchedulerViolation(
            Check.BUDGET,
            step,
            over[0],
            f"the step schedules {scheduled[over[0]]} tokens for {over[0]} beside {len(scheduled) - 1} other "
            f"request(s) ({_listed(scheduled)}), but long_prefill_token_threshold caps a request at {cap} tokens a "
            f"step{floor} while others are in the engine",
            "a request over the long-prefill cap",
        )
    for request, count in scheduled.items():
        computed = events.computed.get(request, 0)
        if computed + count > budgets.max_model_len - 1:
            raise SchedulerViolation(
                Check.BUDGET,
                step,
                request,
                f"the step schedules its positions {computed}..{computed + count - 1} and samples its token at "
                f"position {computed + count}, but max_model_len is {budgets.max_model_len}: no request grows past "
                f"{budgets.max_model_len} tokens, so its last sampled position is {budgets.max_model_len - 1}",
                "a request grown past max_model_len",
            )


def _listed(scheduled: Mapping[str, int]) -> str:
    """Each scheduled request and its tokens, for a violation's message."""
    return ", ".join(f"{request}: {count}" for request, count in scheduled.items())


def check_unsplit(budgets: Budgets, events: StepEvents, known_tokens: Callable[[str], int]) -> None:
    """With chunked prefill off, every request the step admits is scheduled all it has left to compute
    (``known_tokens``: its prompt and the outputs reported for it so far; less what it had computed, its prefix-cache
    hit), drafts aside. A step that schedules it fewer splits its prompt, which chunked prefill off forbids."""
    if budgets.chunked_prefill:
        return
    for request in sorted(events.admitted):
        computed, known = events.computed.get(request, 0), known_tokens(request)
        drafts = events.drafts.get(request, 0)
        scheduled = events.scheduled.get(request, 0) - drafts
        if scheduled < known - computed:
            raise SchedulerViolation(
                Check.BUDGET,
                events.step,
                request,
                f"the step admits it with {scheduled} of the {known - computed} tokens it has left to compute "
                f"(positions {computed}..{computed + scheduled - 1} of its {known}"
                + (f"; {drafts} draft(s) besides" if drafts else "")
                + "), but chunked prefill is off (enable_chunked_prefill=False): vLLM schedules a waiting request's "
                "prompt whole, or not at all",
                "a prompt split with chunked prefill off",
            )
