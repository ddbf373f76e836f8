"""Request variety in the scheduler target beyond prompt, length and priority: cache salts, stop tokens, EOS,
min_tokens and LoRA adapters.

* **Cache salts** (``SchedulerSetup.cache_salts``): a request is drawn with a cache salt from :data:`CACHE_SALTS` or
  none. vLLM folds the salt into the hash of a request's first block, so the prefix cache must never hand a block
  computed under one salt to a request of another (nor to an unsalted one). The worker's K/V of a request is a
  function of its namespace (:func:`salt_namespace`: empty without a salt) and its tokens up to the position, so two
  requests with equal prompts under different salts have different K/V, and the content check sees a hit across
  salts. An unsalted request's K/V is exactly what it was before salts existed.
* **Stop tokens** (``SchedulerSetup.stop_tokens``): a request is drawn with up to :data:`MAX_STOP_TOKENS` stop token
  ids from the fake model's vocabulary. vLLM's ``check_stop`` ends a request at the first sampled token that is one
  of them, that token included in its output (before its length cap is looked at), so its expected output is
  :meth:`~kvfuzz.scheduler.ending.Ending.length` tokens of the fake model's.
* **EOS** (``SchedulerSetup.eos``): a request is drawn ending at the model's EOS token, or ignoring it (as every
  request does without the switch); :mod:`kvfuzz.scheduler.ending`.
* **min_tokens** (``SchedulerSetup.min_tokens``): a request is drawn with ``min_tokens`` up to
  :data:`MAX_MIN_TOKENS` (at most its ``max_tokens``): kvfuzz's sampler samples none of its stop tokens, EOS
  included, before that many outputs (:class:`~kvfuzz.scheduler.fake_model.MinTokens`).
* **LoRA** (``SchedulerSetup.max_loras`` above 0): a request is drawn with one of
  :func:`~kvfuzz.scheduler.lora.lora_adapters` adapters, or none (:mod:`kvfuzz.scheduler.lora`).

Each is drawn only where the setup switches it on, so that the default machine, its examples and its shrunk programs
stay what they were before either existed."""

from __future__ import annotations

from typing import Any, Optional

from hypothesis import strategies as st

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.fake_model import VOCABULARY
from kvfuzz.scheduler.lora import lora_adapters, lora_namespace

CACHE_SALTS = ("a", "b")
"""The cache salts a request may carry, besides none: two, so that equal prompts under two salts are common."""

MAX_STOP_TOKENS = 2
"""A request carries at most this many stop token ids (none, often)."""

MAX_MIN_TOKENS = 6
"""A request is drawn with ``min_tokens`` of at most this many (and at most its ``max_tokens``): beyond a few tokens,
with a quarter of the samples EOS, the mask rarely changes what a request reaches."""


def salt_namespace(cache_salt: Optional[str]) -> tuple[str, ...]:
    """The cache salt's part of a request's K/V namespace: none without a salt (so its K/V is what it always was),
    the salt otherwise. An empty salt is none, as vLLM's block hasher takes it."""
    return ("cache_salt", cache_salt) if cache_salt else ()


def request_namespace(cache_salt: Optional[str], lora: int) -> tuple[str, ...]:
    """The namespace of a request's K/V tags: its cache salt's part, then its LoRA adapter's (each empty where it has
    none, so a request with neither has the K/V it always had)."""
    return salt_namespace(cache_salt) + lora_namespace(lora)


def request_arguments(setup: SchedulerSetup) -> dict[str, Any]:
    """The ``add_request`` rule's extra arguments under ``setup``: a cache salt (or none) with ``cache_salts``, stop
    token ids with ``stop_tokens``, whether it ends at EOS with ``eos``, a ``min_tokens`` (the rule caps it at the
    request's length) with ``min_tokens``, a LoRA adapter (0: none) with ``max_loras``; nothing otherwise (the
    rule's defaults: no salt, no stop tokens, EOS ignored, no min_tokens, no adapter)."""
    arguments: dict[str, Any] = {}
    if setup.cache_salts:
        arguments["cache_salt"] = st.sampled_from((None, *CACHE_SALTS))
    if setup.stop_tokens:
        arguments["stop_token_ids"] = st.lists(
            st.integers(0, VOCABULARY - 1), max_size=MAX_STOP_TOKENS, unique=True
        ).map(tuple)
    if setup.eos:
        arguments["eos"] = st.booleans()
    if setup.min_tokens:
        arguments["min_tokens"] = st.integers(0, MAX_MIN_TOKENS)
    if setup.max_loras:
        arguments["lora"] = st.integers(0, lora_adapters(setup.max_loras))
    return arguments
