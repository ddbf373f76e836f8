"""The fake model kvfuzz plays: the token it samples for a request at a position is a deterministic function of the
two, from a small vocabulary, so every run and replay samples the same tokens and any request's expected output is
known without running it.

kvfuzz also plays vLLM's sampler, and with it the sampler's min-tokens logits processor: before a request has
``min_tokens`` outputs, the sampler never samples one of its stop tokens (its ``all_stop_token_ids``: its stop token
ids and the model's end-of-sequence token :data:`EOS_TOKEN`, whether or not it ignores EOS), the model's token
there replaced by the next one of the vocabulary that is not a stop token (:class:`MinTokens`). vLLM 0.33.0
applies ``min_tokens`` there only: its scheduler's ``check_stop`` ends a request at EOS or a stop token without
looking at ``min_tokens``."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import attrs

from kvfuzz.reference.content import extend_tag, namespace_tag

VOCABULARY = 4
"""Prompts and sampled tokens are drawn from ``range(VOCABULARY)``: a small vocabulary makes shared prefixes and so
prefix-cache hits common."""

EOS_TOKEN = VOCABULARY - 1
"""The model's end-of-sequence token (the client tells vLLM, as its input processor does from the tokenizer): one of
the vocabulary, so the model samples it at about a quarter of the positions; it ends a request that does not
ignore EOS."""


@functools.lru_cache(maxsize=1 << 16)
def sampled_token(request: str, position: int) -> int:
    """The token the fake model samples for ``request`` when its sequence has ``position`` tokens (kept for the
    positions asked lately: the output check and the worker ask for each one several times)."""
    return extend_tag(namespace_tag((request,)), position) % VOCABULARY


def _frozen_tokens(tokens: Iterable[int]) -> frozenset[int]:
    return frozenset(tokens)


@attrs.frozen
class MinTokens:
    """The sampler's min-tokens processor for one request: its first ``min_tokens`` outputs are never one of
    ``stop_token_ids`` (the request's ``all_stop_token_ids``, EOS included)."""

    min_tokens: int = 0
    stop_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_frozen_tokens)

    def token(self, request: str, prompt_length: int, position: int) -> int:
        """The token sampled for ``request`` (``prompt_length`` prompt tokens) when its sequence has ``position``
        tokens: the model's, unless it is a stop token and fewer than ``min_tokens`` outputs precede it, then the
        next token of the vocabulary that is not one (the model's, where every token is one)."""
        token = sampled_token(request, position)
        if position - prompt_length >= self.min_tokens:
            return token
        allowed = [(token + step) % VOCABULARY for step in range(VOCABULARY)]
        return next((candidate for candidate in allowed if candidate not in self.stop_token_ids), token)


UNMASKED = MinTokens()
"""A request without ``min_tokens``: the sampler returns the model's tokens."""


def expected_output(
    request: str, prompt_length: int, count: int, sampler: MinTokens = UNMASKED, start: int = 0
) -> list[int]:
    """The first ``count`` output tokens of a request whose prompt has ``prompt_length`` tokens (from output
    ``#start`` on: the earlier ones left out)."""
    return [sampler.token(request, prompt_length, prompt_length + index) for index in range(start, count)]
