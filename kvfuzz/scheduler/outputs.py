"""Every request's output checked against the fake model: the tokens ``update_from_output`` reports for a request
are exactly :func:`~kvfuzz.scheduler.fake_model.expected_output` (under its ``min_tokens``, as kvfuzz's sampler
masks its stop tokens), in order, none lost or repeated (across preemption and resumption too); a request finishes
with exactly :meth:`~kvfuzz.scheduler.ending.Ending.length` of them (all ``max_tokens``, or up to and including its
first stop token or EOS), never more; nothing follows a finish. A request whose KV load failed under vLLM's ``fail``
policy (:meth:`OutputLedger.receive`'s ``failed``) finishes instead with reason ``error`` in the step whose output
reports the failure, with the outputs it had; no other request finishes with an error."""

from __future__ import annotations

from typing import Any

import attrs

from kvfuzz.scheduler.ending import Ending
from kvfuzz.scheduler.fake_model import EOS_TOKEN, expected_output
from kvfuzz.scheduler.model_length import check_finish_reason
from kvfuzz.scheduler.violations import Check, SchedulerViolation


@attrs.define
class Expected:
    """One request's output so far, and what ends it."""

    prompt_length: int  # the prompt's tokens
    max_tokens: int  # the most output tokens it asks for
    length: int  # the output it finishes with, unless aborted: max_tokens, or up to its first stop token or EOS
    ending: Ending = Ending()  # what ends it early
    received: list[int] = attrs.Factory(list)  # the output tokens reported so far
    finished: bool = False  # reported finished, or aborted
    load_failed: bool = False  # its KV load failed under vLLM's "fail" policy: it finishes with an error

    def why(self, request: str) -> str:
        """Why ``request`` should finish with ``length`` tokens, for a message."""
        whole = self.whole(request)
        conditions = self.ending.describe()
        if whole and whole[-1] in self.ending.stopping:
            return f"its output #{self.length - 1}, {whole[-1]}, is its first stop token ({conditions})"
        stops = f", none of them a stop token ({conditions})" if conditions else ""
        ignored = f", and it ignores EOS ({EOS_TOKEN})" if not self.ending.eos else ""
        return f"its max_tokens is {self.max_tokens}{stops}{ignored}"

    def masked(self, index: int, token: int) -> str:
        """What a message adds when output ``#index`` is ``token``: that the sampler masks it there, if it does."""
        sampler = self.ending.sampler
        if index < sampler.min_tokens and token in sampler.stop_token_ids:
            return (
                f": {token} is a stop token, which the sampler never samples before min_tokens {sampler.min_tokens} "
                "outputs (the min-tokens processor of the sampling params the scheduler's output brought)"
            )
        return ""

    def whole(self, request: str) -> list[int]:
        """The output ``request`` finishes with."""
        return expected_output(request, self.prompt_length, self.length, self.ending.sampler)


class OutputLedger:
    """The outputs of every request of one example."""

    def __init__(self) -> None:
        self.requests: dict[str, Expected] = {}  # request -> its output so far

    def added(self, request: str, prompt_length: int, max_tokens: int, ending: Ending = Ending()) -> None:
        length = ending.length(request, prompt_length, max_tokens)
        self.requests[request] = Expected(prompt_length, max_tokens, length, ending)

    def aborted(self, request: str) -> None:
        self.requests[request].finished = True

    def unfinished(self) -> list[str]:
        return [request for request, expected in self.requests.items() if not expected.finished]

    def receive(self, engine_outputs: dict[int, Any], step: int, failed: frozenset[str] = frozenset()) -> None:
        """Check the outputs ``update_from_output`` returned at ``step``; ``failed``: the requests whose KV load that
        step's output reported failed, which vLLM's ``fail`` policy finishes with an error in these outputs."""
        for request in failed:
            self.requests[request].load_failed = True
        for outputs in engine_outputs.values():
            for output in outputs.outputs:
                finishes = output.finish_reason is not None
                self.record(output.request_id, list(output.new_token_ids), finishes, step, output.finish_reason)
        for request in sorted(failed):
            if not self.requests[request].finished:
                raise SchedulerViolation(
                    Check.OUTPUTS,
                    step,
                    request,
                    f"the KV load of request {request} failed, reported in step {step}'s output; under vLLM's "
                    "kv_load_failure_policy 'fail' the update_from_output() that processes it finishes the request "
                    "with an error, but its outputs did not finish it",
                    "a failed load's request not failed",
                )

    def record(self, request: str, tokens: list[int], finishes: bool, step: int, reason: Any = None) -> None:
        """Check the ``tokens`` an engine reported for ``request`` at ``step`` (``finishes``: and that it finished,
        with finish reason ``reason`` where the engine gives one: :func:`~kvfuzz.scheduler.model_length.
        check_finish_reason`)."""
        expected = self.requests[request]
        if expected.finished and tokens:
            raise SchedulerViolation(
                Check.OUTPUTS,
                step,
                request,
                f"tokens {tokens} reported after the request finished or was aborted",
                "a token after the request finished",
            )
        start = len(expected.received)
        expected.received.extend(tokens)
        sampler, prompt_length = expected.ending.sampler, expected.prompt_length
        # the earlier outputs were checked as they came: only this step's are compared
        if tokens != expected_output(request, prompt_length, len(expected.received), sampler, start):
            want = expected_output(request, prompt_length, len(expected.received), sampler)
            first = next(index for index, (got, ought) in enumerate(zip(expected.received, want)) if got != ought)
            raise SchedulerViolation(
                Check.OUTPUTS,
                step,
                request,
                f"output token #{first} is {expected.received[first]}, but the fake model sampled {want[first]}"
                f"{expected.masked(first, expected.received[first])} (expected output {want}, reported "
                f"{expected.received}; this step reported tokens #{start}..#{len(expected.received) - 1})",
                "a stop token before min_tokens"
                if expected.masked(first, expected.received[first])
                else mismatch_cause(
                    expected.received,
                    expected_output(request, expected.prompt_length, len(want) + 8, expected.ending.sampler),
                    first,
                ),
            )
        if len(expected.received) > expected.length:
            whole = expected.whole(request)
            raise SchedulerViolation(
                Check.OUTPUTS,
                step,
                request,
                f"{len(expected.received)} output tokens {expected.received} reported, but it should have finished "
                f"with {expected.length}: {expected.why(request)} (expected {whole})",
                "a token after a stop token"
                if whole and whole[-1] in expected.ending.stopping
                else "a token past max_tokens",
            )
        if finishes and not expected.finished:
            expected.finished = True
            whole = expected.whole(request)
            if expected.load_failed:
                if str(reason) != "error":
                    raise SchedulerViolation(
                        Check.OUTPUTS,
                        step,
                        request,
                        f"finished with reason {str(reason)!r} and {len(expected.received)} output tokens, but its KV "
                        "load failed, reported in this step's output, and under vLLM's kv_load_failure_policy 'fail' "
                        "it finishes with reason 'error'",
                        "a wrong finish reason",
                    )
                return
            if str(reason) == "error":
                raise SchedulerViolation(
                    Check.OUTPUTS,
                    step,
                    request,
                    f"finished with reason 'error' after {len(expected.received)} of its {expected.length} output "
                    "tokens, but no KV load of it failed (vLLM finishes a request with an error only where its load "
                    "failed under kv_load_failure_policy 'fail')",
                    "an error finish without a failed load",
                )
            if len(expected.received) != expected.length:
                raise SchedulerViolation(
                    Check.OUTPUTS,
                    step,
                    request,
                    f"finished with {len(expected.received)} output tokens {expected.received}, but "
                    f"{expected.why(request)} (expected {whole})",
                    "finished early",
                )
            if reason is not None:
                check_finish_reason(
                    request, reason, bool(whole) and whole[-1] in expected.ending.stopping, expected.why(request), step
                )


def mismatch_cause(received: list[int], sampled: list[int], first: int) -> str:
    """Why the output ``received`` departs at token ``first`` from what the fake model sampled (``sampled``: its
    outputs, a few past ``received``), told by how the rest lines up: shifted on by one (a token lost), back by one
    (a token repeated), its first two swapped (out of order), or none of these. The fake model's vocabulary is
    small, so a rest of one token can line up by chance: the cause is the first reading that fits."""
    rest = received[first:]
    if rest == sampled[first + 1 : first + 1 + len(rest)]:
        return "a token lost"
    if first > 0 and rest == sampled[first - 1 : first - 1 + len(rest)]:
        return "a token repeated"
    if len(rest) >= 2 and rest[:2] == [sampled[first + 1], sampled[first]]:
        return "tokens out of order"
    return "a token other than the one sampled"
