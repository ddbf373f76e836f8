"""Requests that skip reading the prefix cache (``SchedulerSetup.skip_prefix_reads``): vLLM's
``skip_reading_prefix_cache`` sampling parameter, which a request asking for prompt logprobs gets by default (a hit
would leave the positions it covers without the logits the request asked for), and a client may set itself.

With the switch on, a quarter of the requests skip (drawn from the request's id, :func:`skips_reads`, so that a
replay skips the same ones and no program field is needed). vLLM must then give such a request no prefix-cache hit:
neither the local cache's (``KVCacheManager.prefix_cache_lookup_enabled``) nor a KV connector's (the scheduler asks
the connector for nothing). The request still writes its blocks to the cache for others.

Invariant (check ``prefix-hit``, :class:`ReadSkips`): a request that skips reading the prefix cache is scheduled new,
or resumed after preemption, with no computed tokens. A streaming session's later turn, which keeps its own blocks,
is no read of the cache and is not held to it."""

from __future__ import annotations

import zlib

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.violations import Check, SchedulerViolation

SKIP_SHARE = 4
"""One request in this many skips reading the prefix cache when the setup draws skips: most requests still hit, so
that a skipping request meets a cache that holds its prefix."""


def skips_reads(setup: SchedulerSetup, request: str) -> bool:
    """Whether ``request`` skips reading the prefix cache (drawn from its id, so that a replay skips the same)."""
    return setup.skip_prefix_reads and zlib.crc32(f"skip reads {request}".encode()) % SKIP_SHARE == 0


class ReadSkips:
    """The ``prefix-hit`` check of the requests that skip reading the prefix cache."""

    def __init__(self, setup: SchedulerSetup) -> None:
        self.setup = setup

    def check(self, request: str, hit: int, step: int) -> None:
        """``request`` is scheduled new or resumed with ``hit`` computed tokens."""
        if hit and skips_reads(self.setup, request):
            raise SchedulerViolation(
                Check.PREFIX_HIT,
                step,
                request,
                f"it is scheduled with {hit} computed tokens, but it skips reading the prefix cache (its sampling "
                "params' skip_reading_prefix_cache, as a request asking for prompt logprobs has): it must compute "
                "its prompt from the first token",
                "a hit for a request that skips prefix-cache reads",
            )
