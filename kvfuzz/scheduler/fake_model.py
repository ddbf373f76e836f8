"""The fake model kvfuzz plays: the token it samples for a request at a position is a deterministic function of the
two, from a small vocabulary, so every run and replay samples the same tokens and any request's expected output is
known without running it."""

from __future__ import annotations

from kvfuzz.reference.content import extend_tag, namespace_tag

VOCABULARY = 4
"""Prompts and sampled tokens are drawn from ``range(VOCABULARY)``: a small vocabulary makes shared prefixes and so
prefix-cache hits common."""


def sampled_token(request: str, position: int) -> int:
    """The token the fake model samples for ``request`` when its sequence has ``position`` tokens."""
    return extend_tag(namespace_tag((request,)), position) % VOCABULARY


def expected_output(request: str, prompt_length: int, count: int) -> list[int]:
    """The first ``count`` output tokens of a request whose prompt has ``prompt_length`` tokens."""
    return [sampled_token(request, prompt_length + index) for index in range(count)]
