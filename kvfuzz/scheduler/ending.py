"""What ends a request early, as the client asked for it: stop token ids, the model's end-of-sequence token (unless
the request ignores EOS, vLLM's ``ignore_eos``), and ``min_tokens``, the outputs before which neither ends it.

vLLM 0.33.0's scheduler (``check_stop``, per sampled token in ``update_from_output``) ends a request at the first
sampled token that is its EOS token (status ``FINISHED_STOPPED``) or one of its stop token ids, *that token
included* in its output (vLLM's detokenizer leaves EOS out of the text, not out of the token ids), and before its
length cap is looked at. It does not look at ``min_tokens`` there: the sampler's min-tokens logits processor keeps
every stop token, EOS included even where EOS is ignored, from being sampled before ``min_tokens`` outputs, and kvfuzz
plays the sampler (:class:`~kvfuzz.scheduler.fake_model.MinTokens`)."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import attrs

from kvfuzz.scheduler.fake_model import EOS_TOKEN, MinTokens


def _token_ids(tokens: Iterable[int]) -> tuple[int, ...]:
    return tuple(tokens)


@attrs.frozen
class Ending:
    """One request's stop conditions besides its length cap. Invariant: ``min_tokens`` is at most the request's
    ``max_tokens`` (vLLM refuses more)."""

    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)
    eos: bool = False  # ends at the model's EOS token (not ignore_eos)
    min_tokens: int = 0  # outputs before which no stop token is sampled

    @property
    def stopping(self) -> frozenset[int]:
        """The sampled tokens that end the request (past ``min_tokens``)."""
        return frozenset(self.stop_token_ids) | ({EOS_TOKEN} if self.eos else frozenset())

    @property
    def sampler(self) -> MinTokens:
        """The sampler's min-tokens processor for the request: vLLM's ``all_stop_token_ids``, its stop token ids and
        EOS, masked before ``min_tokens`` outputs."""
        return _min_tokens(self.min_tokens, self.stop_token_ids)

    def length(self, request: str, prompt_length: int, max_tokens: int) -> int:
        """How many output tokens ``request`` finishes with, unless aborted: up to and including the first token
        sampled for it that ends it, or ``max_tokens``."""
        sampler = self.sampler
        for index in range(max_tokens):
            if sampler.token(request, prompt_length, prompt_length + index) in self.stopping:
                return index + 1
        return max_tokens

    def describe(self) -> str:
        """The conditions, for a message: ``stop_token_ids [3], EOS 3, min_tokens 2``."""
        parts = [f"stop_token_ids {list(self.stop_token_ids)}"] if self.stop_token_ids else []
        parts += [f"EOS {EOS_TOKEN}"] if self.eos else []
        parts += [f"min_tokens {self.min_tokens}"] if self.min_tokens else []
        return ", ".join(parts)


@functools.lru_cache(maxsize=256)
def _min_tokens(min_tokens: int, stop_token_ids: tuple[int, ...]) -> MinTokens:
    """The min-tokens processor of a request's ``min_tokens`` and stop token ids (EOS added), made once per pair: the
    output check asks for it at every token."""
    return MinTokens(min_tokens, {*stop_token_ids, EOS_TOKEN})
