"""Resumable requests (vLLM's streaming sessions), as the client drives them and as kvfuzz checks them
(``SchedulerSetup.sessions``).

A request added ``resumable`` is a session: where it stops (its ``max_tokens``, a stop token, EOS), vLLM reports its
turn's output with a finish reason but keeps it, paused (``WAITING_FOR_STREAMING_REQ``), holding its blocks. The
client continues it by adding a request of the same id, resumable, with new input (:class:`~kvfuzz.scheduler.
program.Resume`): vLLM's ``_update_request_as_session`` drops the turn's last sampled token (never computed), keeps
every other token as prompt, appends the new input, trims the block hashes to the kept tokens and hashes the rest. A
session paused continues at once; a running one queues the update for its next stop. A request of the same id that
is not resumable closes it (a paused session is aborted; a running one finishes at its next stop).

What kvfuzz checks (**sessions**, besides the content, accounting and output checks that hold for every request):

* the session's tokens, right after each update and after every step, are what the client knows: its turn's
  prompt (the kept tokens and the new input), then the turn's outputs; its block hashes are vLLM's request block
  hasher's over those tokens (none kept for a token dropped);
* it is never scheduled while paused (its turn ended and no update has come), and when resumed it is scheduled
  anew with exactly those tokens (:mod:`kvfuzz.scheduler.worker`);
* each turn's output and finish reason are the fake model's for its prompt (the output ledger, one turn at a time).

The client knows where a turn ends from the output of the step it collected, so sessions are driven with
synchronous scheduling only (:class:`~kvfuzz.scheduler.config.SchedulerSetup` refuses the rest)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import attrs
from hypothesis import strategies as st

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.ending import Ending
from kvfuzz.scheduler.fake_model import VOCABULARY
from kvfuzz.scheduler.outputs import OutputLedger
from kvfuzz.scheduler.violations import Check, SchedulerViolation


def session_arguments(setup: SchedulerSetup) -> dict[str, Any]:
    """The ``add_request`` rule's extra argument under ``sessions``: whether the request is resumable; nothing
    otherwise (not resumable)."""
    return {"resumable": st.booleans()} if setup.sessions else {}


def resume_arguments(setup: SchedulerSetup) -> dict[str, Any]:
    """The ``resume`` rule's arguments: the new input (one token to two blocks) and the outputs it asks for."""
    return {
        "prompt": st.lists(st.integers(0, VOCABULARY - 1), min_size=1, max_size=2 * setup.block_size),
        "max_tokens": st.integers(1, 2 * setup.block_size),
    }


def turn_ending(ending: Ending, max_tokens: int) -> Ending:
    """What ends a turn of ``max_tokens`` outputs: the session's stop conditions, ``min_tokens`` at most
    ``max_tokens`` (vLLM refuses more)."""
    return attrs.evolve(ending, min_tokens=min(ending.min_tokens, max_tokens))


@attrs.frozen
class Turn:
    """One update as the client sent it: its new input and the outputs it asks for (within the model length)."""

    prompt: tuple[int, ...]
    max_tokens: int


@attrs.define
class OpenSession:
    """One session the client has not closed: what it was added with, its current turn's prompt (every token before
    the turn's outputs), the updates sent while it ran (applied in order at its next stops), whether it is paused,
    and whether the client closed it while it ran (it finishes at the stop that leaves no update)."""

    ending: Ending
    cache_salt: Optional[str]
    lora: int
    priority: int
    tokens: list[int]
    queued: list[Turn] = attrs.Factory(list)
    paused: bool = False
    closing: bool = False


@attrs.frozen
class Started:
    """A turn that began: its session, its prompt (kept tokens and the new input) and its ``max_tokens``."""

    request: str
    tokens: tuple[int, ...]
    max_tokens: int


class SessionBook:
    """The client's sessions of one example, and the sessions check."""

    def __init__(self, max_model_len: int, block_size: int) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.open: dict[str, OpenSession] = {}  # session -> its state, until it is closed or aborted
        self.prompts: dict[str, list[int]] = {}  # session -> its last turn's prompt, kept after it is closed

    def opened(
        self, request: str, prompt: list[int], ending: Ending, cache_salt: Optional[str], lora: int, priority: int
    ) -> None:
        self.open[request] = OpenSession(ending, cache_salt, lora, priority, list(prompt))
        self.prompts[request] = list(prompt)

    def tokens(self, request: str, ledger: OutputLedger) -> Optional[list[int]]:
        """The tokens a session holds now (or held when it closed) as the client knows them: its turn's prompt, then
        the turn's outputs reported so far (None for a request that is no session)."""
        prompt = self.prompts.get(request)
        return None if prompt is None else prompt + ledger.requests[request].received

    def plan(self, request: str, prompt: list[int], max_tokens: int, ledger: OutputLedger) -> Optional[Turn]:
        """The update the client sends to continue ``request`` with ``prompt`` and ``max_tokens``: the input cut and
        ``max_tokens`` capped so that the session stays within the model length after the turns already planned; None
        where it is no open session, the client closed it, or no room is left (nothing is sent)."""
        session = self.open.get(request)
        if session is None or session.closing:
            return None
        kept = self._kept_after_plan(request, session, ledger)
        room = self.max_model_len - kept - 1  # at least one output after the new input
        cut = tuple(prompt[:room])
        if not cut:
            return None
        return Turn(cut, max(1, min(max_tokens, self.max_model_len - kept - len(cut))))

    def planned_length(self, request: str, ledger: OutputLedger) -> int:
        """The tokens ``request`` reaches by the end of its last planned turn (the drain's bound)."""
        session = self.open[request]
        return self._kept_after_plan(request, session, ledger) + 1

    def _kept_after_plan(self, request: str, session: OpenSession, ledger: OutputLedger) -> int:
        """The tokens the session keeps after its current turn and every queued one (each turn's length is the fake
        model's, known in advance)."""
        expected = ledger.requests[request]
        kept = len(session.tokens) + expected.length - 1
        for turn in session.queued:
            prompt = kept + len(turn.prompt)
            capped = min(turn.max_tokens, self.max_model_len - prompt)
            kept = prompt + turn_ending(session.ending, capped).length(request, prompt, capped) - 1
        return kept

    def sent(self, request: str, turn: Turn, ledger: OutputLedger) -> Optional[Started]:
        """The client sent ``turn``: a paused session starts it now (vLLM applies it in ``add_request``), a running
        one queues it."""
        session = self.open[request]
        if not session.paused:
            session.queued.append(turn)
            return None
        session.paused = False
        return self._start(request, session, turn, ledger)

    def _start(self, request: str, session: OpenSession, turn: Turn, ledger: OutputLedger) -> Started:
        """The next turn of ``request``: its turn's prompt becomes the kept tokens (the finished turn's last output
        dropped) and the new input, and the ledger expects the new turn's output."""
        received = ledger.requests[request].received
        session.tokens = session.tokens + received[:-1] + list(turn.prompt)
        self.prompts[request] = list(session.tokens)
        capped = min(turn.max_tokens, self.max_model_len - len(session.tokens))
        ledger.added(request, len(session.tokens), capped, turn_ending(session.ending, capped))
        return Started(request, tuple(session.tokens), capped)

    def after_outputs(self, ledger: OutputLedger) -> list[Started]:
        """After a step's outputs: each open session whose turn the step ended starts its next queued turn, pauses,
        or (closed by the client) finishes. Returns the turns that started."""
        started: list[Started] = []
        for request, session in list(self.open.items()):
            if session.paused or not ledger.requests[request].finished:
                continue
            if session.queued:
                started.append(self._start(request, session, session.queued.pop(0), ledger))
            elif session.closing:
                del self.open[request]
            else:
                session.paused = True
        return started

    def close_all(self) -> list[str]:
        """The client closes every open session (arrivals stopped): a paused one ends now, a running one at the stop
        that leaves no update. Returns the sessions to send the close to."""
        closed = []
        for request, session in list(self.open.items()):
            if session.closing:
                continue
            closed.append(request)
            if session.paused:
                del self.open[request]
            else:
                session.closing = True
        return closed

    def aborted(self, request: str) -> None:
        self.open.pop(request, None)

    def is_paused(self, request: str) -> bool:
        session = self.open.get(request)
        return session is not None and session.paused

    def check_scheduled(self, scheduled: Any, step: int) -> None:
        """No paused session is among a step's scheduled requests."""
        for request in scheduled:
            if self.is_paused(request):
                raise SchedulerViolation(
                    Check.SESSIONS,
                    step,
                    request,
                    f"the step schedules {scheduled[request]} token(s) of it, but it is a session paused at its stop "
                    "(its turn finished and its client has sent no new input since): vLLM keeps a paused session "
                    "(WAITING_FOR_STREAMING_REQ) unscheduled until its next input",
                    "a paused session scheduled",
                )

    def check_held(self, scheduler: Any, ledger: OutputLedger, step: int, hashes: Any) -> None:
        """Every open session vLLM holds has the tokens the client knows (:meth:`tokens`), and the block hashes
        ``hashes(request, tokens, cache_salt, lora)`` (vLLM's request block hasher over them) gives."""
        for request, tokens in self._held(scheduler, ledger):
            held = scheduler.requests[request]
            found = list(held.all_token_ids)
            if found != tokens:
                first = next((i for i, (a, b) in enumerate(zip(found, tokens)) if a != b), min(len(found), len(tokens)))
                raise SchedulerViolation(
                    Check.SESSIONS,
                    step,
                    request,
                    f"vLLM holds the session's tokens as {found}, but its client knows {tokens} (its turn's prompt: "
                    f"the tokens it kept and its new input, then the turn's outputs); they differ from position "
                    f"{first}",
                    "a session's tokens other than its kept tokens and new input",
                )
            session = self.open[request]
            want = list(hashes(request, tokens, session.cache_salt, session.lora))
            got = list(held.block_hashes)
            if got != want:
                first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                size = self.block_size
                raise SchedulerViolation(
                    Check.SESSIONS,
                    step,
                    request,
                    f"the session holds {len(got)} block hash(es) for its {len(tokens)} tokens {tokens}, but vLLM's "
                    f"request block hasher gives {len(want)} over them; they differ from block {first} (its tokens "
                    f"{tokens[first * size : (first + 1) * size]}): a hash kept from before the session's last "
                    "update covers a token it dropped or replaced",
                    "a block hash kept past a session's update"
                    if len(got) >= len(want)
                    else "a block hash missing from a session",
                )

    def _held(self, scheduler: Any, ledger: OutputLedger) -> Iterator[tuple[str, list[int]]]:
        for request in self.open:
            held = scheduler.requests.get(request)
            if held is not None and not held.is_finished():
                yield request, self.tokens(request, ledger) or []
