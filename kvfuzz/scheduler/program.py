"""A scheduler target's program: the client's operations an example performed, in order (add a request, abort one, run a
step, reset the prefix cache, resume a streaming session, pause and unpause the scheduler), as plain values, so that
a failure can be saved, replayed and exported without Hypothesis. The drain after them is not part of it: a replay
drains as the machine's teardown does, unless an operation failed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional, Protocol, Union

import attrs


class Client(Protocol):
    """What a program is applied to: the client's side of an example (:class:`kvfuzz.scheduler.session.Session`)."""

    def add(
        self,
        prompt: list[int],
        max_tokens: int,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        stop_token_ids: tuple[int, ...] = (),
        eos: bool = False,
        min_tokens: int = 0,
        lora: int = 0,
        resumable: bool = False,
    ) -> str: ...

    def abort(self, request: str) -> None: ...

    def step(self) -> int: ...

    def reset_prefix_cache(self, preempt: bool = False) -> bool: ...

    def resume(self, request: str, prompt: list[int], max_tokens: int) -> bool: ...

    def pause(self, keep: bool = False) -> None: ...

    def unpause(self) -> None: ...


def _token_ids(tokens: Iterable[int]) -> tuple[int, ...]:
    return tuple(tokens)


@attrs.frozen
class AddRequest:
    """A request arrives with ``prompt`` and asks for ``max_tokens`` tokens (ids ``r0``, ``r1``, ... in order), of
    ``priority`` (the priority policy runs smaller first), under ``cache_salt`` (the prefix cache shares blocks only
    between requests of the same salt), ending early at the first sampled token among ``stop_token_ids``, or at the
    model's end-of-sequence token unless it ignores EOS (``eos`` false: vLLM's ``ignore_eos``), but never before
    ``min_tokens`` outputs, under LoRA adapter ``lora`` (an id from 1; 0: none), ``resumable`` (a streaming session:
    it pauses where it stops, and :class:`Resume` continues it). Each is left out of the JSON and the source at its
    default (0, no salt, no stop tokens, EOS ignored, no min_tokens, no adapter, not resumable), so that a program
    without them reads, saves and digests as it did before they existed."""

    prompt: tuple[int, ...] = attrs.field(converter=_token_ids)
    max_tokens: int
    priority: int = 0
    cache_salt: Optional[str] = None
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)
    eos: bool = False
    min_tokens: int = 0
    lora: int = 0
    resumable: bool = False

    def apply(self, session: Client) -> None:
        session.add(
            list(self.prompt),
            self.max_tokens,
            self.priority,
            self.cache_salt,
            self.stop_token_ids,
            self.eos,
            self.min_tokens,
            self.lora,
            self.resumable,
        )

    def _extras(self) -> dict[str, Any]:
        """The fields not at their defaults, by name."""
        extras: dict[str, Any] = {}
        if self.priority:
            extras["priority"] = self.priority
        if self.cache_salt is not None:
            extras["cache_salt"] = self.cache_salt
        if self.stop_token_ids:
            extras["stop_token_ids"] = list(self.stop_token_ids)
        if self.eos:
            extras["eos"] = True
        if self.min_tokens:
            extras["min_tokens"] = self.min_tokens
        if self.lora:
            extras["lora"] = self.lora
        if self.resumable:
            extras["resumable"] = True
        return extras

    def to_json(self) -> dict[str, Any]:
        return {"op": "add", "prompt": list(self.prompt), "max_tokens": self.max_tokens, **self._extras()}

    def __str__(self) -> str:
        extras = "".join(f", {name}={value!r}" for name, value in self._extras().items())
        return f"add(prompt={list(self.prompt)}, max_tokens={self.max_tokens}{extras})"

    def source(self, client: str) -> str:
        """The Python statement that performs it on ``client`` (an exported test's)."""
        extras = "".join(f", {name}={value!r}" for name, value in self._extras().items())
        return f"{client}.add({list(self.prompt)}, {self.max_tokens}{extras})"


@attrs.frozen
class Abort:
    """The client aborts ``request`` (a finished one is left alone, as vLLM leaves it)."""

    request: str

    def apply(self, session: Client) -> None:
        session.abort(self.request)

    def to_json(self) -> dict[str, Any]:
        return {"op": "abort", "request": self.request}

    def __str__(self) -> str:
        return f"abort({self.request!r})"

    def source(self, client: str) -> str:
        return f"{client}.abort({self.request!r})"


@attrs.frozen
class Step:
    """One engine step: ``schedule()``, the worker, ``update_from_output()``, every check."""

    def apply(self, session: Client) -> None:
        session.step()

    def to_json(self) -> dict[str, Any]:
        return {"op": "step"}

    def __str__(self) -> str:
        return "step()"

    def source(self, client: str) -> str:
        return f"{client}.step()"


@attrs.frozen
class ResetPrefixCache:
    """The client resets the prefix cache (vLLM's ``Scheduler.reset_prefix_cache``), as an RLHF trainer does after
    it updates the weights: refused while blocks are in use, unless ``preempt`` (``reset_running_requests``) first
    preempts every running request. ``preempt`` is left out of the JSON and the source when false."""

    preempt: bool = False

    def apply(self, session: Client) -> None:
        session.reset_prefix_cache(self.preempt)

    def to_json(self) -> dict[str, Any]:
        return {"op": "reset_prefix_cache", **({"preempt": True} if self.preempt else {})}

    def __str__(self) -> str:
        return "reset_prefix_cache(preempt=True)" if self.preempt else "reset_prefix_cache()"

    def source(self, client: str) -> str:
        return f"{client}.{self}"


@attrs.frozen
class Resume:
    """The client continues streaming session ``request`` (one added ``resumable``) with ``prompt``, new input after
    the tokens it kept, asking for ``max_tokens`` more outputs (vLLM: a request of the same id, resumable, added
    again). A session paused at its stop continues at once; a running one queues it for its next stop
    (:mod:`kvfuzz.scheduler.sessions`)."""

    request: str
    prompt: tuple[int, ...] = attrs.field(converter=_token_ids)
    max_tokens: int

    def apply(self, session: Client) -> None:
        session.resume(self.request, list(self.prompt), self.max_tokens)

    def to_json(self) -> dict[str, Any]:
        return {"op": "resume", "request": self.request, "prompt": list(self.prompt), "max_tokens": self.max_tokens}

    def __str__(self) -> str:
        return f"resume({self.request!r}, prompt={list(self.prompt)}, max_tokens={self.max_tokens})"

    def source(self, client: str) -> str:
        return f"{client}.resume({self.request!r}, {list(self.prompt)}, {self.max_tokens})"


@attrs.frozen
class Pause:
    """The client pauses the scheduler (vLLM's engine core ``pause_scheduler``): no new request starts, or with
    ``keep`` nothing is scheduled, until :class:`Unpause` (:mod:`kvfuzz.scheduler.pausing`). ``keep`` is left out of
    the JSON and the source when false."""

    keep: bool = False

    def apply(self, session: Client) -> None:
        session.pause(self.keep)

    def to_json(self) -> dict[str, Any]:
        return {"op": "pause", **({"keep": True} if self.keep else {})}

    def __str__(self) -> str:
        return "pause(keep=True)" if self.keep else "pause()"

    def source(self, client: str) -> str:
        return f"{client}.{self}"


@attrs.frozen
class Unpause:
    """The client resumes a paused scheduler (vLLM's engine core ``resume_scheduler``)."""

    def apply(self, session: Client) -> None:
        session.unpause()

    def to_json(self) -> dict[str, Any]:
        return {"op": "unpause"}

    def __str__(self) -> str:
        return "unpause()"

    def source(self, client: str) -> str:
        return f"{client}.unpause()"


Operation = Union[AddRequest, Abort, Step, ResetPrefixCache, Resume, Pause, Unpause]
"""One operation of a scheduler program."""


def program_source(program: Iterable[Operation], client: str = "state") -> str:
    """``program`` as the calls that perform it on ``client``, one a line, then the drain (as Hypothesis prints a
    falsifying example of the machine)."""
    return "\n".join([*(operation.source(client) for operation in program), f"{client}.drain()"])
