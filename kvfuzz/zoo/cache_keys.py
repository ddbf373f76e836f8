"""Zoo variants whose slip is in the prefix-cache key: two different prefixes keyed alike, and the key trusted."""

from __future__ import annotations

from typing import Optional

from kvfuzz.allocator.paged import PagedAllocator
from kvfuzz.allocator.prefix_cache import PrefixCache, chain_hash
from kvfuzz.allocator.types import Namespace, Tokens
from kvfuzz.engine.violations import Invariant
from kvfuzz.zoo.entry import Variant


def token_sum(block_tokens: Tokens) -> int:
    """The sum of a block's token ids: a key whose weights cancel, so any reordering of the tokens, or raising one
    token by as much as another is lowered, keeps it."""
    return sum(block_tokens)


class _TrustsTheKey(PrefixCache):
    """A lookup that returns the block registered under the hash without comparing namespace or tokens."""

    def lookup(self, block_hash: int, namespace: Namespace, prefix: Tokens) -> Optional[int]:
        return self.first_block(block_hash)


class CollidingBlockKey(PagedAllocator):
    """Class 1, a colliding prefix-cache key trusted without comparing tokens: each block is keyed by an arithmetic
    combination of its token ids whose weights cancel (here their sum), chained to the previous block's key, and a
    lookup trusts the key alone, so a prompt whose block holds the same tokens in another order, or one token raised
    as much as another is lowered, is served another prompt's K/V. Megatron-LM's prefix cache shipped a polynomial
    hash with such a collision (token[j] += 31, token[j+1] -= 1); vLLM (CVE-2025-25183) and OpenVINO GenAI trusted
    keys that could collide without confirming the tokens.
    """

    cache_class = _TrustsTheKey

    def _full_block_hashes(self, namespace: Namespace, tokens: Tokens, hashes: list[int]) -> list[int]:
        size = self.block_size
        for index in range(len(hashes), len(tokens) // size):
            previous = hashes[index - 1] if index else None
            block_key = (token_sum(tokens[index * size : (index + 1) * size]),)
            hashes.append(chain_hash(previous, namespace, block_key))
        return hashes


VARIANTS: tuple[Variant, ...] = (
    Variant(CollidingBlockKey, "1 colliding cache key", Invariant.CACHE_SOUNDNESS, cause="expect different K/V in it"),
)
"""This module's slips, in the zoo's order, each with its bug class and the invariant that must catch it."""
