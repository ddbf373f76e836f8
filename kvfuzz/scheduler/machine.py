"""The Hypothesis state machine over the real scheduler: operations are requests (add one, abort one) and steps, so
a failing example shrinks to the fewest requests and steps that still fail, as Hypothesis shrinks. Its teardown
stops arrivals and drains every request (the progress check)."""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, precondition, rule

from kvfuzz.program.safeguards import Journal, Watchdog
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.engines import installed_version
from kvfuzz.scheduler.fake_model import VOCABULARY
from kvfuzz.scheduler.harness import raise_if_kvfuzz_s
from kvfuzz.scheduler.model_length import overlong_arguments
from kvfuzz.scheduler.offloading import TransferTally
from kvfuzz.scheduler.priority import priority_arguments
from kvfuzz.scheduler.requests import request_arguments
from kvfuzz.scheduler.session import Session, WorkerFactory
from kvfuzz.scheduler.sessions import resume_arguments, session_arguments
from kvfuzz.scheduler.worker import Worker

T = TypeVar("T")

Witness = Callable[[Session, BaseException], None]
"""Told of every example that fails, with its session (whose ``program`` holds the operations) and the failure:
the first one Hypothesis finds, its shrinking attempts, and the shrunk example it replays last."""

SHARED = tuple((index * 5 + index // 3) % VOCABULARY for index in range(256))
"""The token stream every shared prefix is a start of: prompts that pick the same prefix share its blocks."""


@attrs.define
class Tally:
    """Examples and steps counted over every machine a search builds (shrinking's replays included)."""

    examples: int = 0  # machines torn down
    steps: int = 0  # their schedule() calls, the drains' included
    preemptions: int = 0  # requests the scheduler preempted
    hit_tokens: int = 0  # tokens found computed in the prefix cache
    drafts: int = 0  # speculative drafts scheduled (the scheduler's placeholders included)
    accepted_drafts: int = 0  # of them, accepted by the fake model
    rewrites: int = 0  # async scheduling: released blocks written while a step that read them was in flight
    transfers: TransferTally = attrs.Factory(TransferTally)  # the KV connector's transfers
    lora_held_back: int = 0  # LoRA: steps after which the adapter limit held a waiting request back


def prefix_lengths(setup: SchedulerSetup) -> tuple[int, ...]:
    """The shared prefixes a prompt may start with: none, one block, one block and a half, two blocks."""
    size = setup.block_size
    return (0, size, size + size // 2, 2 * size)


def machine_for_setup(
    setup: SchedulerSetup,
    worker: WorkerFactory = Worker,
    tally: Optional[Tally] = None,
    witness: Optional[Witness] = None,
    session: Optional[Callable[[], Any]] = None,
    name: str = "VllmV1SchedulerMachine",
    watchdog: Optional[Watchdog] = None,
    journal: Optional[Journal] = None,
) -> type[RuleBasedStateMachine]:
    """A state machine class driving fresh ``Scheduler`` instances of ``setup`` with ``worker``, counting into
    ``tally``, telling ``witness`` of each failing example, and bounding each step with ``watchdog`` (entered by the
    caller) when one is given, and keeping each example's program in ``journal`` when one is given. ``session``
    builds another engine's session instead (:class:`kvfuzz.scheduler.sglang.session.SGLangSession`: the same client
    operations, counters and ``program``; the factory gives it its own watchdog and journal)."""
    new_session = session if session is not None else (lambda: Session(setup, worker, watchdog, journal))
    engine_name, package = ("SGLang", "sglang") if session is not None else ("vLLM", "vllm")

    def engine() -> str:
        """What a harness error names as driven (read only when one is raised)."""
        return f"{engine_name} {installed_version(package)}"

    prefixes = prefix_lengths(setup)
    longest = setup.max_model_len

    class SchedulerMachine(RuleBasedStateMachine):
        requests = Bundle("requests")

        def __init__(self) -> None:
            super().__init__()
            try:
                self.session = new_session()  # one example's scheduler, worker and outputs
            except BaseException as error:
                raise_if_kvfuzz_s(error, engine)
                raise
            self.failed = False  # an operation raised (a check, or vLLM itself): the teardown does not drain

        def _guarded(self, action: Callable[[], T]) -> T:
            """``action()``, noting a failure so that the teardown leaves the broken example alone; an exception
            kvfuzz's own code raised ends the search as a :class:`~kvfuzz.scheduler.harness.HarnessError`."""
            try:
                return action()
            except BaseException as error:
                self.failed = True
                raise_if_kvfuzz_s(error, lambda: self.session.engine)
                self._witness(error)
                raise

        def _witness(self, error: BaseException) -> None:
            if witness is not None and isinstance(error, Exception):  # not a KeyboardInterrupt
                witness(self.session, error)

        @rule(
            target=requests,
            prefix=st.sampled_from(prefixes),
            suffix=st.lists(st.integers(0, VOCABULARY - 1), max_size=2 * setup.block_size),
            max_tokens=st.integers(1, max(2 * setup.block_size, longest // 4)),
            **priority_arguments(setup),
            **request_arguments(setup),
            **overlong_arguments(setup),
            **session_arguments(setup),
        )
        def add_request(
            self,
            prefix: int,
            suffix: list[int],
            max_tokens: int,
            priority: int = 0,
            cache_salt: Optional[str] = None,
            stop_token_ids: tuple[int, ...] = (),
            eos: bool = False,
            min_tokens: int = 0,
            lora: int = 0,
            past: int = 0,
            resumable: bool = False,
        ) -> str:
            prompt = (list(SHARED[:prefix]) + suffix)[: longest - 1] or [0]
            # within the room the prompt leaves, or (overlong requests) ``past`` tokens beyond it
            length = longest - len(prompt) + past if past else min(max_tokens, longest - len(prompt))
            least = min(min_tokens, length)
            return self._guarded(
                lambda: self.session.add(
                    prompt, length, priority, cache_salt, stop_token_ids, eos, least, lora, resumable
                )
            )

        @rule(request=requests)
        def abort(self, request: str) -> None:
            self._guarded(lambda: self.session.abort(request))

        @precondition(lambda self: self.session.busy())
        @rule()
        def step(self) -> None:
            self._guarded(self.session.step)

        if setup.prefix_resets:  # drawn only where the setup asks, so the default machine draws what it always did

            @rule(preempt=st.booleans() if not setup.async_scheduling else st.just(False))
            def reset_prefix_cache(self, preempt: bool) -> None:
                self._guarded(lambda: self.session.reset_prefix_cache(preempt))

        if setup.pauses:  # drawn only where the setup asks, as resets are

            @rule(keep=st.booleans())
            def pause(self, keep: bool) -> None:
                self._guarded(lambda: self.session.pause(keep))

            @rule()
            def unpause(self) -> None:
                self._guarded(self.session.unpause)

        if setup.sessions:  # drawn only where the setup asks, as resets are

            @rule(request=requests, **resume_arguments(setup))
            def resume(self, request: str, prompt: list[int], max_tokens: int) -> None:
                self._guarded(lambda: self.session.resume(request, prompt, max_tokens))

        def teardown(self) -> None:
            try:
                if not self.failed:
                    self.session.drain()
            except BaseException as error:
                raise_if_kvfuzz_s(error, lambda: self.session.engine)
                self._witness(error)
                raise
            finally:
                if tally is not None:
                    tally.examples += 1
                    tally.steps += self.session.steps
                    tally.preemptions += self.session.preemptions
                    tally.hit_tokens += self.session.hit_tokens
                    scheduled, accepted = self.session.draft_counts()
                    tally.drafts += scheduled
                    tally.accepted_drafts += accepted
                    tally.rewrites += self.session.released_rewrites()
                    tally.transfers.add(self.session.transfer_counts())
                    tally.lora_held_back += self.session.lora_held_back()

    SchedulerMachine.__name__ = SchedulerMachine.__qualname__ = name
    return SchedulerMachine
