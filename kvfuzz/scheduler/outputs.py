"""Every request's output checked against the fake model: the tokens ``update_from_output`` reports for a request
are exactly :func:`~kvfuzz.scheduler.fake_model.expected_output`, in order, none lost or repeated (across preemption
and resumption too); a request that finishes by length has all ``max_tokens`` of them; nothing follows a finish."""

from __future__ import annotations

from typing import Any

import attrs

from kvfuzz.scheduler.fake_model import expected_output
from kvfuzz.scheduler.violations import Check, SchedulerViolation


@attrs.define
class Expected:
    """One request's output so far, and what ends it."""

    prompt_length: int  # the prompt's tokens
    max_tokens: int  # the output it finishes with, unless aborted
    received: list[int] = attrs.Factory(list)  # the output tokens reported so far
    finished: bool = False  # reported finished, or aborted


class OutputLedger:
    """The outputs of every request of one example."""

    def __init__(self) -> None:
        self.requests: dict[str, Expected] = {}  # request -> its output so far

    def added(self, request: str, prompt_length: int, max_tokens: int) -> None:
        self.requests[request] = Expected(prompt_length, max_tokens)

    def aborted(self, request: str) -> None:
        self.requests[request].finished = True

    def unfinished(self) -> list[str]:
        return [request for request, expected in self.requests.items() if not expected.finished]

    def receive(self, engine_outputs: dict[int, Any], step: int) -> None:
        """Check the outputs ``update_from_output`` returned at ``step``."""
        for outputs in engine_outputs.values():
            for output in outputs.outputs:
                self.record(output.request_id, list(output.new_token_ids), output.finish_reason is not None, step)

    def record(self, request: str, tokens: list[int], finishes: bool, step: int) -> None:
        """Check the ``tokens`` an engine reported for ``request`` at ``step`` (``finishes``: and that it finished)."""
        expected = self.requests[request]
        if expected.finished and tokens:
            raise SchedulerViolation(
                Check.OUTPUTS, step, request, f"tokens {tokens} reported after the request finished or was aborted"
            )
        start = len(expected.received)
        expected.received.extend(tokens)
        want = expected_output(request, expected.prompt_length, len(expected.received))
        if expected.received != want:
            first = next(index for index, (got, ought) in enumerate(zip(expected.received, want)) if got != ought)
            raise SchedulerViolation(
                Check.OUTPUTS,
                step,
                request,
                f"output token #{first} is {expected.received[first]}, but the fake model sampled {want[first]} "
                f"(expected output {want}, reported {expected.received}; this step reported tokens "
                f"#{start}..#{len(expected.received) - 1})",
            )
        if finishes and not expected.finished:
            expected.finished = True
            whole = expected_output(request, expected.prompt_length, expected.max_tokens)
            if len(expected.received) != expected.max_tokens:
                raise SchedulerViolation(
                    Check.OUTPUTS,
                    step,
                    request,
                    f"finished with {len(expected.received)} output tokens {expected.received}, but its max_tokens "
                    f"is {expected.max_tokens} (expected {whole})",
                )
