"""Requests that run into ``max_model_len``, and the finish reason every request ends with.

vLLM's engine accepts a request whose prompt is shorter than ``max_model_len`` whatever its ``max_tokens`` (its input
processor checks the prompt alone; only the OpenAI server caps ``max_tokens`` at the room left), and its scheduler's
``check_stop`` ends the request once its tokens reach ``max_model_len``, with finish reason ``length``. Every other
request of the target is drawn within the room its prompt leaves; with ``SchedulerSetup.overlong_requests`` an add may
ask for up to :func:`overlong_limit` tokens in all, so that a request runs into the model length.

What is checked: such a request finishes with exactly ``max_model_len - len(prompt)`` outputs (fewer where a stop
token or EOS ends it first), the output check's count (:func:`capped_max_tokens` is what the ledger expects), and
every request's finish reason (:func:`check_finish_reason`) is ``stop`` when its last output is one of its stop
tokens or EOS, and ``length`` otherwise."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.violations import Check, SchedulerViolation


def overlong_limit(setup: SchedulerSetup) -> int:
    """The most tokens (prompt and ``max_tokens``) an add may ask for under ``overlong_requests``: twice the model
    length, so that a request may ask for well past it."""
    return 2 * setup.max_model_len


def overlong_arguments(setup: SchedulerSetup) -> dict[str, Any]:
    """The ``add_request`` rule's extra argument under ``overlong_requests``: how many tokens past the room its prompt
    leaves it asks for (0: within the room, as every other request); nothing otherwise."""
    return {"past": st.integers(0, setup.max_model_len)} if setup.overlong_requests else {}


def capped_max_tokens(setup: SchedulerSetup, prompt_length: int, max_tokens: int) -> int:
    """The outputs a request of ``max_tokens`` can produce before its tokens reach ``max_model_len``."""
    return min(max_tokens, setup.max_model_len - prompt_length)


def check_finish_reason(request: str, reason: Any, stopped: bool, why: str, step: int) -> None:
    """``request`` finished with ``reason`` (vLLM's ``FinishReason``; its ``str`` is ``stop``, ``length``, ...): it
    must be ``stop`` when its last output is a stop token or EOS (``stopped``), ``length`` otherwise (``why``: why it
    finished, for the message)."""
    expected = "stop" if stopped else "length"
    if str(reason) != expected:
        raise SchedulerViolation(
            Check.OUTPUTS,
            step,
            request,
            f"finished with reason {str(reason)!r}, but {why}: its reason is {expected!r}",
            "a wrong finish reason",
        )
