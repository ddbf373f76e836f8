"""vLLM's KV cache events (``SchedulerSetup.kv_events``), checked against the block pool: what a KV-aware router reads
to know which prefixes an engine holds.

vLLM's scheduler takes the events its block pool queued (``BlockStored`` when a block is cached, ``BlockRemoved`` when
a cached block loses its hash, ``AllBlocksCleared`` at a prefix-cache reset) at the end of each
``update_from_output`` and publishes them. kvfuzz stands in for the publisher (:class:`EventLedger`) and keeps what a
router would: how many blocks of the engine's GPU pool hold each hash, per KV-cache group. Right after each
``update_from_output`` (every queued event taken) and once the example is quiescent:

* **announced exactly as cached**: for every (hash, group), the events' count (stored, less removed, zeroed at a
  clear) equals the number of the pool's blocks that hold that hash (their primary hash or a partial entry). A block
  cached without a ``BlockStored``, announced twice, removed without a ``BlockRemoved``, or removed while never
  stored, makes them differ; a ``BlockRemoved`` of a hash the events hold no block of fails at once;
* **the right hash and parent**: every hash a ``BlockStored`` announces names the tokens it covers. kvfuzz knows
  every request's tokens (its prompt and the fake model's outputs) and computes the hash of each of its full-block
  prefixes with vLLM's request block hasher (under the request's cache salt and LoRA adapter); an announced hash must
  be the hash of the event's parent's prefix followed by the start of the event's ``token_ids`` (the parent's prefix
  empty when ``parent_block_hash`` is null), each next hash covering more of them. The request hasher hashes every
  ``SchedulerSetup.hash_block_size`` tokens (the block size, or a finer ``prefix_match_unit``: partial prefix
  caching, whose partial entries' events are of that size); checked for events of a multiple of it, a group of
  another block size being held to the count alone.

**Full reports** (``SchedulerSetup.kv_events_full``): half the requests, drawn per request id (:func:`full_reports`),
ask for ``kv_cache_report_mode="full"``, and for them vLLM also announces the cached blocks a prefix-cache lookup
reuses (a ``BlockStored`` per KV-cache group, parent null, from the prompt's start), so that a router learns what a
request found, not only what it cached. The ledger watches the manager's lookups (``get_computed_blocks``, wrapped
on the scheduler's own instance) and holds them to it:

* **every reuse announced, and only for those who asked**: a lookup that hit ``n`` blocks of a group for a request
  that asked for full reports is followed by one ``BlockStored`` of that group announcing ``n`` blocks; a lookup for
  a request that did not ask announces nothing;
* **a re-announcement is no new block**: its hashes are checked as any ``BlockStored``'s (the right tokens, the
  right parent), and, in a full-attention group, each must be one the events hold a block of (a router must not
  learn of a block the pool does not cache); it leaves the counts as they are.

Events of another medium (a KV connector's offload store) are not the pool's, and are left out."""

from __future__ import annotations

import zlib
from collections import Counter
from typing import Any, Callable, Iterable, Optional

import attrs

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.ending import Ending
from kvfuzz.scheduler.requests import request_namespace
from kvfuzz.scheduler.violations import Check, SchedulerViolation

Key = tuple[Any, int]
"""(the external block hash an event carries, the KV-cache group)."""


@attrs.frozen
class KnownRequest:
    """A request as kvfuzz knows it: its id, tokens (the prompt, then its outputs so far), cache salt and adapter."""

    request: str
    tokens: tuple[int, ...]
    cache_salt: Optional[str]
    lora: int


def full_reports(setup: SchedulerSetup, request: str) -> bool:
    """Whether ``request`` asks for full KV cache event reports (half the requests, drawn from the id, so that a
    replay asks the same)."""
    return setup.kv_events_full and zlib.crc32(f"report {request}".encode()) % 2 == 0


@attrs.frozen
class Lookup:
    """One prefix-cache lookup the manager made (``get_computed_blocks``): for which request, whether it asked for
    full reports, the blocks it hit in each group, and the events the lookup queued (re-announcements)."""

    request: str
    full: bool
    hit_blocks: tuple[int, ...]  # per KV-cache group
    hit_tokens: int
    emitted: tuple[Any, ...]


def pool_hashes(pool: Any, external: Callable[[Any], Key]) -> dict[Key, list[int]]:
    """(hash, group) -> the blocks of ``pool`` that hold it (their primary hash or a partial entry), the hash as the
    events carry it (``external``: a pool key as the events name it)."""
    held: dict[Key, list[int]] = {}
    partial = pool.cached_block_hashes_by_block
    for block in pool.blocks:
        keys = [block.block_hash] if block.block_hash is not None else []
        if partial:
            keys += partial.get(block.block_id, ())
        for key in keys:
            held.setdefault(external(key), []).append(block.block_id)
    return held


class EventLedger:
    """The publisher kvfuzz installs in the scheduler, and the router's view its events build."""

    def __init__(self, setup: SchedulerSetup) -> None:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        from kvfuzz.scheduler.vllm_build import hash_lookahead

        self.block_size = setup.hash_block_size  # the request hasher's block size
        self.lookahead = hash_lookahead(setup)  # the tokens after a block its hash covers (an EAGLE head's)
        self.external = maybe_convert_block_hash  # a pool hash as the events carry it
        self.keys: dict[Any, Key] = {}  # a pool key (hash and group) -> (hash, group) as the events carry them
        self.pending: list[Any] = []  # events published and not yet checked
        self.announced: Counter[Key] = Counter()  # (hash, group) -> blocks the events say hold it
        self.prefixes: dict[Any, tuple[tuple[str, ...], tuple[int, ...]]] = {}  # hash -> (namespace, its tokens)
        # request -> the tokens its hashes in ``prefixes`` cover: its full blocks' (and the lookahead after them; a
        # session's change as it resumes)
        self.hashed: dict[str, tuple[int, ...]] = {}
        self.medium: Optional[str] = None  # the pool's medium (read from the pool when first checked)
        self.events = 0  # events checked so far
        self.setup = setup  # which requests asked for full reports (full_reports)
        self.lookups: list[Lookup] = []  # the lookups made since the last check
        self.full_groups: frozenset[int] = frozenset()  # the full-attention groups (set when installed)
        self.reannounced = 0  # re-announcements checked so far (full reports)

    def install(self, scheduler: Any) -> None:
        """Publish into this ledger, and watch the manager's lookups (on this scheduler's instance only)."""
        scheduler.kv_event_publisher = self
        manager = scheduler.kv_cache_manager
        groups = manager.kv_cache_config.kv_cache_groups
        self.full_groups = frozenset(
            index for index, group in enumerate(groups) if type(group.kv_cache_spec).__name__ == "FullAttentionSpec"
        )
        pools = list(dict.fromkeys(single.block_pool for single in manager.coordinator.single_type_managers))
        lookup = manager.get_computed_blocks

        def get_computed_blocks(request: Any, *args: Any, **kwargs: Any) -> Any:
            queued = [len(pool.kv_event_queue) for pool in pools]
            found = lookup(request, *args, **kwargs)
            emitted = tuple(event for pool, start in zip(pools, queued) for event in pool.kv_event_queue[start:])
            blocks, tokens = found[0], found[1]
            hit = tuple(len(group) for group in blocks.blocks)
            full = full_reports(self.setup, request.request_id)  # what the client asked, not what vLLM read
            self.lookups.append(Lookup(request.request_id, full, hit, tokens, emitted))
            return found

        manager.get_computed_blocks = get_computed_blocks

    # -- vLLM's EventPublisher -------------------------------------------------------------------------------------

    def publish(self, batch: Any) -> None:
        self.pending.extend(batch.events)

    def shutdown(self) -> None:
        """Nothing to release."""

    # -- the check -------------------------------------------------------------------------------------------------

    def check(self, scheduler: Any, requests: Callable[[], Iterable[KnownRequest]], step: int) -> None:
        """Apply the events published since the last check, in order, each ``BlockStored``'s hashes checked against
        the tokens of ``requests()`` (every request, as kvfuzz knows it); then the events' counts against the pool's."""
        pool = scheduler.kv_cache_manager.block_pool
        self.medium = pool.medium
        events, self.pending = self.pending, []
        lookups, self.lookups = self.lookups, []
        if any(type(event).__name__ == "BlockStored" for event in events):
            self._learn(requests())
        again = {id(event) for found in lookups for event in found.emitted}
        for event in events:
            self.events += 1
            if id(event) in again:
                self._reannounce(event, step)
            else:
                self._apply(event, step)
        for found in lookups:
            self._check_lookup(found, step)
        holders = pool_hashes(pool, self._key)
        announced = self.announced
        wrong = [key for key in holders.keys() | announced.keys() if len(holders.get(key, ())) != announced[key]]
        if wrong:
            key = min(wrong, key=repr)  # the first in one order, whatever order the pool and events came in
            blocks = holders.get(key, [])
            raise SchedulerViolation(
                Check.KV_EVENTS,
                step,
                None,
                f"the KV cache events leave {self.announced[key]} block(s) holding hash {_short(key[0])} (group "
                f"{key[1]}), but the pool caches it in {len(blocks)} block(s) {blocks}: "
                + (
                    "a block was cached without a BlockStored, or a removal announced twice"
                    if len(blocks) > self.announced[key]
                    else "a block was announced twice, or lost its hash without a BlockRemoved"
                ),
                "events disagree with the pool" if blocks else "a cached block removed unannounced",
            )

    def flush(self, scheduler: Any, requests: Callable[[], Iterable[KnownRequest]], step: int) -> None:
        """At quiescence: take the events the scheduler still queues (a reset's, after the last step) as its next
        ``update_from_output`` would, and check."""
        self.pending.extend(scheduler.kv_cache_manager.take_events())
        self.check(scheduler, requests, step)

    def _key(self, pool_key: Any) -> Key:
        """A pool key (a block hash with its group) as the events carry it: (the external hash, the group), made once
        per key (vLLM's conversion of a hash is the costly part of comparing the pool with the events)."""
        key = self.keys.get(pool_key)
        if key is None:
            from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

            key = self.keys[pool_key] = (self.external(get_block_hash(pool_key)), get_group_id(pool_key))
        return key

    def _learn(self, requests: Iterable[KnownRequest]) -> None:
        """The hash of every full-block prefix of every request's tokens, by vLLM's request block hasher (with
        lookahead hashes, of every full block the tokens after it cover too)."""
        from kvfuzz.scheduler.vllm_build import new_request

        for known in requests:
            hashable = max(0, len(known.tokens) - self.lookahead) // self.block_size * self.block_size
            covered = known.tokens[: hashable + self.lookahead if hashable else 0]  # what the hashes cover
            if self.hashed.get(known.request, ())[: len(covered)] == covered:
                continue
            self.hashed[known.request] = covered
            mirror = new_request(
                known.request,
                list(known.tokens),
                1,
                self.block_size,
                0,
                0,
                known.cache_salt,
                Ending(),
                known.lora,
                hash_lookahead=self.lookahead,
            )
            namespace = request_namespace(known.cache_salt, known.lora)
            for index, block_hash in enumerate(mirror.block_hashes):
                self.prefixes[self.external(block_hash)] = (namespace, known.tokens[: (index + 1) * self.block_size])

    def _apply(self, event: Any, step: int) -> None:
        kind = type(event).__name__
        if kind == "AllBlocksCleared":
            self.announced.clear()
            return
        if event.medium != self.medium:
            return  # a KV connector's store: not the pool
        if kind == "BlockRemoved":
            for block_hash in event.block_hashes:
                key = (block_hash, event.group_idx)
                if self.announced[key] <= 0:
                    raise SchedulerViolation(
                        Check.KV_EVENTS,
                        step,
                        None,
                        f"a BlockRemoved event removes hash {_short(block_hash)} (group {event.group_idx}), which the "
                        "events hold no block of: never announced as stored, or removed already",
                        "a removal of a block never stored",
                    )
                self.announced[key] -= 1
                if not self.announced[key]:
                    del self.announced[key]  # the check walks the hashes held, not every hash ever announced
            return
        if kind == "BlockStored":
            if event.block_size % self.block_size == 0:
                self._check_chain(event, step)
            for block_hash in event.block_hashes:
                self.announced[(block_hash, event.group_idx)] += 1

    def _check_lookup(self, found: Lookup, step: int) -> None:
        """A lookup for a request that asked for full reports announced each group's hit blocks once; one for a
        request that did not announced nothing."""
        if not found.full:
            if found.emitted:
                raise SchedulerViolation(
                    Check.KV_EVENTS,
                    step,
                    found.request,
                    f"a prefix-cache lookup for request {found.request}, which asked for incremental KV cache event "
                    f"reports, announced {len(found.emitted)} event(s) of the blocks it reused",
                    "a reuse announced unasked",
                )
            return
        announced = Counter(
            (event.group_idx, len(event.block_hashes))
            for event in found.emitted
            if type(event).__name__ == "BlockStored"
        )
        expected = Counter(
            (group, blocks) for group, blocks in enumerate(found.hit_blocks) if blocks and found.hit_tokens > 0
        )
        if announced == expected:
            return
        raise SchedulerViolation(
            Check.KV_EVENTS,
            step,
            found.request,
            f"a prefix-cache lookup for request {found.request}, which asked for full KV cache event reports, hit "
            f"{found.hit_tokens} token(s) ({_groups(expected)}), but announced {_groups(announced) or 'nothing'}",
            "a reuse not announced" if not announced else "a reuse announced wrong",
        )

    def _reannounce(self, event: Any, step: int) -> None:
        """A ``BlockStored`` a lookup queued for a request asking for full reports: hashes checked, counts kept."""
        self.reannounced += 1
        if event.medium != self.medium:
            return
        if event.block_size % self.block_size == 0:
            self._check_chain(event, step)
        if event.group_idx not in self.full_groups:
            return  # a sliding window's or a Mamba group's hit names blocks it no longer holds (null in the table)
        for index, block_hash in enumerate(event.block_hashes):
            if self.announced[(block_hash, event.group_idx)] > 0:
                continue
            raise SchedulerViolation(
                Check.KV_EVENTS,
                step,
                None,
                f"a BlockStored event re-announcing a prefix-cache hit (a full report) names hash {_short(block_hash)} "
                f"as its block {index} (group {event.group_idx}), which the events hold no block of: the pool does "
                "not cache it",
                "a reuse of a block never stored",
            )

    def _check_chain(self, event: Any, step: int) -> None:
        """Each announced hash is the hash of the parent's prefix followed by the start of the event's tokens."""
        tokens = tuple(event.token_ids)
        namespace: Optional[tuple[str, ...]] = None
        base: tuple[int, ...] = ()
        if event.parent_block_hash is not None:
            parent = self.prefixes.get(event.parent_block_hash)
            if parent is None:
                raise SchedulerViolation(
                    Check.KV_EVENTS,
                    step,
                    None,
                    f"a BlockStored event's parent hash {_short(event.parent_block_hash)} is the hash of no prefix of "
                    f"any request's tokens (the event stores {len(event.block_hashes)} block(s) of tokens "
                    f"{list(tokens)})",
                    "a wrong parent hash",
                )
            namespace, base = parent
        covered = len(base)
        for index, block_hash in enumerate(event.block_hashes):
            found = self.prefixes.get(block_hash)
            expected_start = list(base + tokens)
            if (
                found is None
                or (namespace is not None and found[0] != namespace)
                or len(found[1]) <= covered
                or list(found[1]) != expected_start[: len(found[1])]
            ):
                named = (
                    "the hash of no prefix of any request's tokens"
                    if found is None
                    else (
                        f"the hash of the {len(found[1])}-token prefix {list(found[1])}"
                        + (f" under {found[0]}" if found[0] else "")
                    )
                )
                raise SchedulerViolation(
                    Check.KV_EVENTS,
                    step,
                    None,
                    f"a BlockStored event announces hash {_short(block_hash)} as its block {index} (parent "
                    f"{_short(event.parent_block_hash)}, tokens {list(tokens)}), but it is {named}; the event says "
                    f"it covers {list(base)} + {list(tokens)} up to its block {index}",
                    "a wrong block hash",
                )
            covered = len(found[1])
            namespace = found[0]


def _groups(announced: Counter[tuple[int, int]]) -> str:
    """``2 block(s) of group 0, 1 of group 1``: what was (to be) announced, for a message."""
    return ", ".join(
        f"{blocks} block(s) of group {group}" + (f" ({times} times)" if times > 1 else "")
        for (group, blocks), times in sorted(announced.items())
    )


def _short(block_hash: Any) -> str:
    """A hash for a message: an integer in hex, bytes by their first 8 in hex; null as ``null``."""
    if block_hash is None:
        return "null"
    if isinstance(block_hash, bytes):
        return block_hash[:8].hex()
    return f"{block_hash:#x}"


class NoEvents:
    """KV cache events off: nothing to check."""

    events = 0

    def check(self, scheduler: Any, requests: Callable[[], Iterable[KnownRequest]], step: int) -> None:
        """Nothing: no events are published."""

    def flush(self, scheduler: Any, requests: Callable[[], Iterable[KnownRequest]], step: int) -> None:
        """Nothing: no events are queued."""


def event_checker(setup: SchedulerSetup, scheduler: Any) -> EventLedger | NoEvents:
    """The events' checker of an example: an :class:`EventLedger` installed as ``scheduler``'s publisher when
    ``setup.kv_events``, else :class:`NoEvents`."""
    if not setup.kv_events:
        return NoEvents()
    ledger = EventLedger(setup)
    ledger.install(scheduler)
    return ledger
