"""A scheduler target's program: the client's operations an example performed, in order (add a request, abort one,
run a step), as plain values, so that a failure can be saved, replayed and exported without Hypothesis. The drain
after them is not part of it: a replay drains as the machine's teardown does, unless an operation failed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, Union

import attrs


class Client(Protocol):
    """What a program is applied to: the client's side of an example (:class:`kvfuzz.scheduler.session.Session`)."""

    def add(self, prompt: list[int], max_tokens: int) -> str: ...

    def abort(self, request: str) -> None: ...

    def step(self) -> int: ...


def _token_ids(tokens: Iterable[int]) -> tuple[int, ...]:
    return tuple(tokens)


@attrs.frozen
class AddRequest:
    """A request arrives with ``prompt`` and asks for ``max_tokens`` tokens (ids ``r0``, ``r1``, ... in order)."""

    prompt: tuple[int, ...] = attrs.field(converter=_token_ids)
    max_tokens: int

    def apply(self, session: Client) -> None:
        session.add(list(self.prompt), self.max_tokens)

    def to_json(self) -> dict[str, Any]:
        return {"op": "add", "prompt": list(self.prompt), "max_tokens": self.max_tokens}

    def __str__(self) -> str:
        return f"add(prompt={list(self.prompt)}, max_tokens={self.max_tokens})"

    def source(self, client: str) -> str:
        """The Python statement that performs it on ``client`` (an exported test's)."""
        return f"{client}.add({list(self.prompt)}, {self.max_tokens})"


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


Operation = Union[AddRequest, Abort, Step]
"""One operation of a scheduler program."""
