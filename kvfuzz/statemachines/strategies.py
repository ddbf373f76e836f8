"""How the machine draws requests: prompts that share prefixes often, and namespaces that differ subtly.

Prompts are a shared "system prompt" (lengths chosen around block boundaries) followed by a short, non-empty suffix
over a tiny vocabulary, so equal prefixes, equal full blocks and near misses are common. Namespaces include pairs whose parts
concatenate to the same string, and the same tokens are drawn under several namespaces.
"""

from __future__ import annotations

import functools

from hypothesis import strategies as st

from kvfuzz.allocator.types import Namespace

VOCABULARY = 4

NAMESPACES: tuple[Namespace, ...] = ((), ("ab", "c"), ("a", "bc"), ("lora-7",))


def system_prompts(block_size: int) -> list[tuple[int, ...]]:
    """Shared prefixes just below, at, and just past block boundaries."""
    lengths = sorted({0, block_size - 1, block_size, 2 * block_size, 2 * block_size + 1})
    return [tuple((i * 7 + length) % VOCABULARY for i in range(length)) for length in lengths if length >= 0]


@functools.lru_cache(maxsize=None)
def systems(block_size: int) -> st.SearchStrategy[tuple[int, ...]]:
    """The shared part of a prompt; a prompt is a system prompt plus a non-empty suffix."""
    return st.sampled_from(system_prompts(block_size))


@functools.lru_cache(maxsize=None)
def suffixes(block_size: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, VOCABULARY - 1), min_size=1, max_size=block_size + 2)


@functools.lru_cache(maxsize=None)
def namespaces(enabled: bool) -> st.SearchStrategy[Namespace]:
    """Mostly the empty namespace, so that most requests can share; the two whose parts concatenate alike come
    next, since Hypothesis favours the first choices."""
    return st.sampled_from(NAMESPACES if enabled else ((),))


@functools.lru_cache(maxsize=None)
def appended_tokens(block_size: int) -> st.SearchStrategy[list[int]]:
    """A decode step (one token) half the time, else a chunk or a run of speculative drafts."""
    token = st.integers(0, VOCABULARY - 1)
    return st.one_of(st.lists(token, min_size=1, max_size=1), st.lists(token, min_size=2, max_size=block_size + 1))
