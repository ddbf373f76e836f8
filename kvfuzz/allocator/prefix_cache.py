"""The prefix cache of kvfuzz's own allocator: which physical block holds the K/V of which full-block prefix.

A full block is keyed by a chained hash: the hash of (the previous block's hash, or the namespace for the first block)
and the block's tokens. A lookup never trusts the hash alone: the entry keeps the namespace and the whole token
prefix up to the block's end, and a hit must match both exactly. A hash may map to several blocks holding the same
content (two sequences that computed the same prefix before either was cached, as vLLM keeps them), so that evicting
one copy leaves the other matchable; each block has at most one entry.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import attrs

from kvfuzz.allocator.types import Namespace, Tokens


def chain_hash(previous: Optional[int], namespace: Namespace, block_tokens: Tokens) -> int:
    """Hash of one full block given the hash of the block before it (``None`` for the first block)."""
    parts = (previous, namespace if previous is None else None, block_tokens)
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@attrs.frozen
class CacheEntry:
    """What a cached block holds: the K/V of ``prefix`` (every token up to the block's end) under ``namespace``."""

    block_hash: int
    namespace: Namespace
    prefix: Tokens


class PrefixCache:
    """Map between cache entries and physical blocks: each hash to the blocks registered under it, oldest first,
    and each block to its entry."""

    def __init__(self) -> None:
        self._blocks_by_hash: dict[int, dict[int, None]] = {}
        self._entry_by_block: dict[int, CacheEntry] = {}

    def lookup(self, block_hash: int, namespace: Namespace, prefix: Tokens) -> Optional[int]:
        """The first block registered as holding exactly ``prefix`` under ``namespace``, or ``None``."""
        for block in self._blocks_by_hash.get(block_hash, ()):
            entry = self._entry_by_block[block]
            if entry.namespace == namespace and entry.prefix == prefix:
                return block
        return None

    def first_block(self, block_hash: int) -> Optional[int]:
        """The first block registered under ``block_hash``, whatever prefix it holds (only a variant that trusts the
        hash alone asks this), or ``None``."""
        return next(iter(self._blocks_by_hash.get(block_hash, ())), None)

    def register(self, block: int, entry: CacheEntry) -> None:
        """Make ``block`` matchable as ``entry``, unless the block already has an entry."""
        if block in self._entry_by_block:
            return
        self._blocks_by_hash.setdefault(entry.block_hash, {})[block] = None
        self._entry_by_block[block] = entry

    def unregister(self, block: int) -> None:
        entry = self._entry_by_block.pop(block, None)
        if entry is not None:
            blocks = self._blocks_by_hash[entry.block_hash]
            del blocks[block]
            if not blocks:
                del self._blocks_by_hash[entry.block_hash]

    def is_cached(self, block: int) -> bool:
        return block in self._entry_by_block
