"""Speculative decoding as kvfuzz's model runner plays it: drafts proposed after each step that samples, the drafts
the scheduler schedules verified against the fake model, and the scheduler's rollback of rejected drafts checked.

The fake model verifies greedily: a request whose sequence has ``L`` tokens, scheduled with drafts ``d0 .. dk-1`` at
positions ``L .. L + k - 1``, accepts ``d0`` if it is the token the fake model samples at ``L``, then ``d1`` if it is
the one at ``L + 1``, and so on up to the first mismatch; it returns the accepted drafts and one more sample (the
bonus token, the fake model's own where the first rejected draft stood). So the tokens returned are always the fake
model's, in order, whatever was drafted, and a rejected draft never reaches the output.

The drafter is a deterministic function of the request and the position, as the fake model is: the draft for a
position is the fake model's token there with probability about 2/3 (so acceptance is real, and runs of accepted
drafts are common), another token otherwise; a proposal is ``k`` drafts long, or occasionally shorter (a drafter
finds no continuation). The scheduler's ``-1`` placeholders (drafts it pads a resumed request's one-token step with)
are never accepted.

Invariants :class:`Speculation` holds the scheduler to, at every step:

* the drafts scheduled for a request are a start of the ones proposed for it after its last step, at the positions
  they were proposed for (or all placeholders), and fill exactly the scheduled positions beyond its known tokens;
* after a step with drafts, the scheduler's ``num_computed_tokens`` of the request is its known tokens before the
  step plus the accepted drafts: the rejected drafts' positions rolled back, so that their slots, which hold a
  rejected draft's K/V, are stale: no claim relies on them (the next write over them is legal) and the next step
  recomputes the first of them with the bonus token.

Under async scheduling (:class:`AsyncSpeculation`, vLLM's V2 model runner's protocol) the scheduler never sees a
draft: it schedules ``-1`` placeholders on an optimistic count, the worker verifies its own drafts in their place at
positions from its own count, and the scheduler's count is held to the worker's plus the rejections of the steps
still in flight.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs

from kvfuzz.reference.content import extend_tag, namespace_tag
from kvfuzz.scheduler.fake_model import VOCABULARY, sampled_token
from kvfuzz.scheduler.violations import Check, SchedulerViolation

PLACEHOLDER = -1
"""The draft token vLLM's scheduler pads a resumed request's step with: never accepted."""


def draft_token(request: str, position: int) -> int:
    """The drafter's token for ``request`` at ``position``: the fake model's, or (about a third of the time) another."""
    roll = extend_tag(namespace_tag(("draft", request)), position)
    model = sampled_token(request, position)
    if roll % 3:
        return model
    return (model + 1 + (roll >> 8) % (VOCABULARY - 1)) % VOCABULARY


def proposal(request: str, position: int, k: int) -> list[int]:
    """The drafts proposed for a request whose sequence has ``position`` tokens: ``k`` of them, or (one time in five)
    fewer, none included."""
    roll = extend_tag(namespace_tag(("drafts", request)), position)
    count = k if roll % 5 else (roll >> 8) % k
    return [draft_token(request, position + index) for index in range(count)]


def accepted(request: str, position: int, drafts: list[int]) -> int:
    """How many of ``drafts`` (at positions ``position ..``) greedy verification against the fake model accepts."""
    count = 0
    for index, draft in enumerate(drafts):
        if draft != sampled_token(request, position + index):
            break
        count += 1
    return count


def span(first: int, stop: int, verb: str = "") -> str:
    """Positions ``first .. stop - 1`` (at least one) for a message, with ``verb`` (plural, "hold") agreeing:
    ``position 3 holds`` or ``positions 3..5 hold``."""
    if stop - first == 1:
        return f"position {first}" + (f" {verb}s" if verb else "")
    return f"positions {first}..{stop - 1}" + (f" {verb}" if verb else "")


@attrs.frozen
class Verified:
    """What a step's verification of one request's drafts found."""

    drafts: tuple[int, ...]  # the drafts scheduled
    accepted: int  # how many of them were accepted (a start of them)
    computed: int  # the positions whose K/V is valid after the step: known tokens before it plus the accepted


@attrs.define
class DraftStats:
    """Drafts counted over one example."""

    scheduled: int = 0  # drafts scheduled (placeholders included)
    accepted: int = 0  # of them, accepted
    placeholders: int = 0  # of them, the scheduler's placeholders


class Speculation:
    """The worker's speculative decoding with ``k`` drafts: what it proposed to each request, what the scheduler
    scheduled of it this step, and the check of the rollback."""

    def __init__(self, k: int) -> None:
        self.k = k  # the most drafts a proposal holds (vLLM's num_speculative_tokens)
        self.proposed: dict[str, tuple[int, list[int]]] = {}  # request -> (first position, drafts) proposed last
        self.scheduled: dict[str, list[int]] = {}  # request -> its drafts scheduled this step
        self.verified: dict[str, Verified] = {}  # request -> the last verification of its drafts, until checked
        self.stats = DraftStats()  # drafts counted

    def forget(self, request: str) -> None:
        """The worker dropped ``request`` (finished, or preempted under the V2 runner)."""
        self.proposed.pop(request, None)
        self.verified.pop(request, None)

    def in_flight(self, request: str) -> int:
        """Rejected drafts of ``request`` the scheduler still counts (as computed, and as output placeholders): none
        under synchronous scheduling, where each step's output returns before the next is scheduled."""
        return 0

    def position(self, request: str, computed: int, own: int, step: int) -> int:
        """Where a request the scheduler schedules again (not resumed) computes from: the scheduler's
        ``num_computed_tokens`` (``computed``), checked against the last verification of its drafts (``own``: the
        worker's count, unused here)."""
        self.check_computed(request, computed, step)
        return computed

    def returned(self, step: int) -> None:
        """Step ``step``'s output went back to the scheduler: nothing is kept per step here."""

    def check_computed(self, request: str, computed: int, step: int) -> None:
        """The scheduler's ``num_computed_tokens`` of a request it schedules again (not resumed), after a step that
        verified drafts of it: the known tokens plus the accepted drafts, the rejected ones rolled back."""
        verified = self.verified.pop(request, None)
        if verified is None or computed == verified.computed:
            return
        rejected = len(verified.drafts) - verified.accepted
        known = verified.computed - verified.accepted  # the tokens known before the step
        drafted = known + len(verified.drafts)  # one past the last draft's position
        if computed > verified.computed:
            wrong = [
                f"{span(verified.computed, min(computed, drafted), 'hold')} rejected drafts' K/V"
                if verified.computed < min(computed, drafted)
                else "",
                f"{span(max(verified.computed, drafted), computed, 'lie')} beyond the drafts the step verified "
                "(nothing was computed there)"
                if computed > drafted
                else "",
            ]
            found = " and ".join(part for part in wrong if part) + ", so they must be recomputed"
            cause = "rejected drafts not rolled back" if wrong[0] else "computed tokens counted past the drafts"
        else:
            wrong = [
                f"{span(computed, min(known, verified.computed), 'hold')} known tokens' K/V"
                if computed < known
                else "",
                f"{span(max(computed, known), verified.computed, 'hold')} accepted drafts' K/V"
                if max(computed, known) < verified.computed
                else "",
            ]
            found = " and ".join(part for part in wrong if part) + ", rolled back too"
            cause = "valid K/V rolled back"
        raise SchedulerViolation(
            Check.SPECULATIVE,
            step,
            request,
            f"the scheduler counts {computed} computed tokens, but its last step verified drafts "
            f"{list(verified.drafts)} ({verified.accepted} accepted, {rejected} rejected), after which "
            f"{span(0, verified.computed, 'hold')} valid K/V: {found}",
            cause,
        )

    def schedule(self, output: Any, known: dict[str, int], step: int) -> None:
        """Read the drafts the scheduler scheduled this step (``known``: each scheduled request's known tokens) and
        check them against what was proposed."""
        self.scheduled = {}
        for request, drafts in output.scheduled_spec_decode_tokens.items():
            drafts = list(drafts)
            self.scheduled[request] = drafts
            self.stats.scheduled += len(drafts)
            if drafts and all(draft == PLACEHOLDER for draft in drafts):
                self.stats.placeholders += len(drafts)
                continue
            start, proposed = self.proposed.get(request, (None, []))
            if drafts != proposed[: len(drafts)] or start != known[request]:
                raise SchedulerViolation(
                    Check.SPECULATIVE,
                    step,
                    request,
                    f"scheduled with drafts {drafts} at positions from {known[request]}, but the drafts proposed for "
                    + ("it were none" if start is None else f"it were {proposed} at positions from {start}"),
                    "drafts scheduled other than proposed",
                )

    def drafts(self, request: str) -> list[int]:
        """The drafts scheduled for ``request`` this step."""
        return self.scheduled.get(request, [])

    def verify(self, request: str, known: int, end: int, step: int) -> Verified:
        """Verify the drafts of a request with ``known`` tokens scheduled up to position ``end``: they must fill
        exactly the positions beyond the known tokens."""
        drafts = self.drafts(request)
        if known + len(drafts) != end:
            raise SchedulerViolation(
                Check.SPECULATIVE,
                step,
                request,
                f"positions up to {end - 1} scheduled with {len(drafts)} draft(s) {drafts}, but the request has "
                f"{known} known tokens: "
                + (
                    f"the drafts must fill {span(known, end)}"
                    if end > known
                    else "no position beyond them is scheduled, so no draft may be"
                ),
                "drafts at the wrong positions",
            )
        count = accepted(request, known, drafts)
        self.stats.accepted += count
        verified = Verified(tuple(drafts), count, known + count)
        if drafts:
            self.verified[request] = verified
        return verified

    def propose(self, output: Any, sampled: dict[str, int]) -> Optional[tuple[list[str], list[list[int]]]]:
        """The drafts proposed after this step for every request that sampled (``sampled``: its sequence's length
        now), as the model runner's ``take_draft_token_ids`` gives them; None where the step asks for none. A request
        the step did not schedule keeps the drafts proposed before, as the scheduler keeps them; one it scheduled has
        none but what this step proposes."""
        for request in output.num_scheduled_tokens:
            self.proposed.pop(request, None)
        if getattr(output, "skip_drafts", False):
            return None
        order, drafts = [], []
        for request, length in sampled.items():
            proposed = proposal(request, length, self.k)
            self.proposed[request] = (length, proposed)
            order.append(request)
            drafts.append(list(proposed))
        return order, drafts


class AsyncSpeculation(Speculation):
    """Speculative decoding under async scheduling, as vLLM's V2 model runner plays it: the engine core never hands
    the drafts to the scheduler (``post_step`` skips ``take_draft_token_ids`` under async), so the ``AsyncScheduler``
    schedules each decode with ``-1`` placeholders (as many as the step's ``num_spec_tokens_to_schedule``) on top of
    an optimistic count (every placeholder computed, ``1 + drafts`` output placeholders), and the runner, which ran
    the step before on the device, puts its own drafts in their place at positions from its own count.

    Invariants, at every step: the drafts scheduled are all placeholders; the worker verifies its own proposal (made
    after the request's last step, at the position its sequence has now; placeholders where it has none or a
    shorter one) in their place; the scheduler's ``num_computed_tokens`` of a request it schedules again is the
    worker's own count plus the drafts of it that steps still in flight rejected (rolled back only when their output
    returns), and its output count is the worker's samples plus the same."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.rejected: dict[int, dict[str, int]] = {}  # step in flight -> request -> drafts it rejected

    def forget(self, request: str) -> None:
        """The worker dropped ``request``: a preemption resets the scheduler's counts, a finish ends them."""
        super().forget(request)
        for requests in self.rejected.values():
            requests.pop(request, None)

    def in_flight(self, request: str) -> int:
        return sum(requests.get(request, 0) for requests in self.rejected.values())

    def position(self, request: str, computed: int, own: int, step: int) -> int:
        """The worker's own count (the V2 runner's, kept on the device), once the scheduler's optimistic one is
        checked against it."""
        pending = self.in_flight(request)
        if computed != own + pending:
            steps = sorted(step for step, requests in self.rejected.items() if requests.get(request))
            flight = (
                f"the {pending} draft(s) of it rejected by step(s) {steps}, in flight"
                if pending
                else "no draft of it rejected in a step in flight"
            )
            valid = span(0, own, "hold") if own else "no position holds"
            raise SchedulerViolation(
                Check.SPECULATIVE,
                step,
                request,
                f"the scheduler counts {computed} computed tokens, but {valid} valid K/V and {flight}: it should "
                f"count {own + pending}",
                "rejected drafts not rolled back" if computed > own + pending else "valid K/V rolled back",
            )
        return own

    def returned(self, step: int) -> None:
        """Step ``step``'s output went back: the scheduler rolled its rejected drafts back."""
        self.rejected.pop(step, None)

    def schedule(self, output: Any, known: dict[str, int], step: int) -> None:
        """Check that the scheduler scheduled only placeholders, and put the worker's own drafts in their place."""
        self.scheduled = {}
        for request, drafts in output.scheduled_spec_decode_tokens.items():
            drafts = list(drafts)
            if any(draft != PLACEHOLDER for draft in drafts):
                raise SchedulerViolation(
                    Check.SPECULATIVE,
                    step,
                    request,
                    f"scheduled with drafts {drafts} under async scheduling, where the engine core hands the scheduler "
                    "no drafts: it schedules -1 placeholders, which the model runner fills with its own",
                    "drafts scheduled other than proposed",
                )
            start, proposed = self.proposed.get(request, (None, []))
            own = proposed[: len(drafts)] if start == known[request] else []
            self.scheduled[request] = own + [PLACEHOLDER] * (len(drafts) - len(own))
            self.stats.scheduled += len(drafts)
            self.stats.placeholders += len(drafts) - len(own)

    def verify(self, request: str, known: int, end: int, step: int) -> Verified:
        verified = super().verify(request, known, end, step)
        self.verified.pop(request, None)  # checked through the per-step counts instead
        if verified.drafts:
            self.rejected.setdefault(step, {})[request] = len(verified.drafts) - verified.accepted
        return verified

    def propose(self, output: Any, sampled: dict[str, int]) -> Optional[tuple[list[str], list[list[int]]]]:
        """The drafts proposed after this step, kept by the worker (the runner keeps them on the device): the engine
        core takes none."""
        super().propose(output, sampled)
        return None


class NoSpeculation:
    """The worker without speculative decoding: no drafts proposed, and none may be scheduled."""

    def __init__(self) -> None:
        self.stats = DraftStats()  # always zero: nothing drafted

    def forget(self, request: str) -> None:
        """Nothing is kept per request."""

    def in_flight(self, request: str) -> int:
        """No draft is ever counted."""
        return 0

    def position(self, request: str, computed: int, own: int, step: int) -> int:
        """The scheduler's count: no draft was verified, so nothing rolls back."""
        return computed

    def returned(self, step: int) -> None:
        """Nothing is kept per step."""

    def check_computed(self, request: str, computed: int, step: int) -> None:
        """No draft was verified, so nothing rolls back."""

    def schedule(self, output: Any, known: dict[str, int], step: int) -> None:
        """No drafts may be scheduled: none was proposed."""
        for request, drafts in output.scheduled_spec_decode_tokens.items():
            if drafts:
                raise SchedulerViolation(
                    Check.SPECULATIVE,
                    step,
                    request,
                    f"scheduled with drafts {list(drafts)}, but speculative decoding is off and none was proposed",
                    "drafts scheduled other than proposed",
                )

    def drafts(self, request: str) -> list[int]:
        return []

    def verify(self, request: str, known: int, end: int, step: int) -> Verified:
        return Verified((), 0, end)

    def propose(self, output: Any, sampled: dict[str, int]) -> Optional[tuple[list[str], list[list[int]]]]:
        return None


def speculation_for(k: int, async_scheduling: bool = False) -> Speculation | NoSpeculation:
    """The worker's speculative decoding with ``k`` drafts (none when ``k`` is 0), under async scheduling as vLLM's
    V2 model runner plays it."""
    if not k:
        return NoSpeculation()
    return AsyncSpeculation(k) if async_scheduling else Speculation(k)
