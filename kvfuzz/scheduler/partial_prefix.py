"""vLLM's copy-on-write block copies (``SchedulerOutput.kv_cache_block_copies``), run by kvfuzz's model runner as
vLLM's runs them: partial prefix caching (``SchedulerSetup.prefix_match_unit``).

With prefix hashes finer than the block (a Mamba hybrid in ``align`` mode, vLLM's ``partial_hash_hits_enabled``), a
prefix-cache hit may end inside a block: the block pool keeps a *partial entry* (``BlockPool.cache_partial_block``)
that makes a block reachable from the hash of a prefix ending inside it (the prompt's last hash boundary below its
last token: ``_cache_partial_tail_block`` of the attention and Mamba managers). A request that hits one does not
share the block (it will write the rest of it): its manager gives it a fresh block in that table entry and asks the
runner to copy the whole block into it (``_apply_cow``). In a Mamba group the producer of a partial tail has its
running state in that block, which its next step overwrites: its manager moves the entry to a fresh block and asks
for the same copy first (``MambaManager.allocate_new_blocks``). vLLM's runner copies every listed ``(source,
destination)`` block (every layer's page: the pool is shared by the groups) after zeroing the step's new blocks and
before the forward pass; so does :func:`copy_blocks`, before the step's writes, and the step's checks then read the
copy: the content check that a hit's positions hold the request's own tokens' K/V, the Mamba state check that a hit
resumes from the state after exactly its computed tokens.

Invariants of each copy (check ``exclusive`` for the destination, ``content`` for the null block): neither end is
vLLM's null block; the destination is not a block a live request still needs (the copy would overwrite what that
request relies on); a destination is written by one copy a step.

And of every hit (check ``prefix-hit``, :class:`HitAlignment`; every configuration without a KV connector, whose
loads may end anywhere): a request scheduled new or resumed with ``c`` tokens from the prefix cache has ``c`` a
multiple of the hash block (vLLM's ``cache_hit_alignment_tokens``: the block size, or ``prefix_match_unit`` with
partial hits) and below its token count (vLLM matches at most all tokens but the last, whose logits it needs)."""

from __future__ import annotations

from typing import Any, Iterable, Union

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.kv_slots import SlotPool
from kvfuzz.scheduler.mamba_states import MambaStates
from kvfuzz.scheduler.violations import Check, SchedulerViolation


def copy_blocks(copies: Iterable[Any], kv: SlotPool, mamba: MambaStates, held: dict[str, list[int]], step: int) -> int:
    """Run the step's block copies (``(src_block_id, dst_block_id)`` pairs) in order, each checked against ``held``
    (the blocks each live request still needs, before the step): the K/V slots and every Mamba group's state of the
    source block become the destination's. Returns how many were run."""
    written: set[int] = set()
    count = 0
    for source, destination in copies:
        if 0 in (source, destination):
            raise SchedulerViolation(
                Check.CONTENT,
                step,
                None,
                f"the step copies block {source} into block {destination} (a copy-on-write of a partial prefix-cache "
                "hit), but vLLM's null block 0 is neither read nor written",
                "a block copy with the null block",
            )
        if destination in written or destination == source:
            raise SchedulerViolation(
                Check.EXCLUSIVE,
                step,
                None,
                f"the step copies block {source} into block {destination}, which "
                + ("is its own source" if destination == source else "another copy of the step writes too"),
                "two writes of one block copy",
            )
        written.add(destination)
        for request, blocks in sorted(held.items()):
            if destination in blocks:
                raise SchedulerViolation(
                    Check.EXCLUSIVE,
                    step,
                    request,
                    f"the step copies block {source} into block {destination} (a copy-on-write of a partial "
                    f"prefix-cache hit), but request {request} still holds block {destination}: the copy overwrites "
                    "what it relies on",
                    "a block copy over a held block",
                )
        kv.copy_block(source, destination)
        mamba.copy_block(source, destination)
        count += 1
    return count


class HitAlignment:
    """The ``prefix-hit`` check: hits of whole hash blocks (``unit`` tokens each), short of the last token."""

    def __init__(self, unit: int) -> None:
        self.unit = unit  # tokens per prefix-cache hash

    def check(self, request: str, hit: int, tokens: int, step: int) -> None:
        """``request``, scheduled new or resumed with ``hit`` of its ``tokens`` tokens from the prefix cache."""
        if hit % self.unit:
            raise SchedulerViolation(
                Check.PREFIX_HIT,
                step,
                request,
                f"it is scheduled with {hit} tokens from the prefix cache, which is not a multiple of the "
                f"{self.unit}-token prefix hash: a hit ends where a cached hash ends",
                "a hit off the hash boundaries",
            )
        if hit >= tokens:
            raise SchedulerViolation(
                Check.PREFIX_HIT,
                step,
                request,
                f"it is scheduled with {hit} tokens from the prefix cache, but has only {tokens}: a hit leaves the "
                "last token to compute",
                "a hit of the whole sequence",
            )


class NoHitCheck:
    """A KV connector's loads may end anywhere: hits are not held to the hash boundaries."""

    def check(self, request: str, hit: int, tokens: int, step: int) -> None:
        """Nothing."""


def hit_check(setup: SchedulerSetup) -> Union[HitAlignment, NoHitCheck]:
    """The hit check of ``setup``: :class:`HitAlignment` at its hash block, or none under a KV connector."""
    return HitAlignment(setup.hash_block_size) if setup.kv_connector == "none" else NoHitCheck()
