"""The swarm table of ``kvfuzz campaign --scheduler sglang``: vLLM's rows (:data:`kvfuzz.scheduler.swarm.DIMENSIONS`)
where SGLang's target takes the same option, and its own where it differs: pages of at least 2 tokens (SGLang
serves page size 1 with another allocator), and one value for what the SGLang target does not drive (FCFS, the
full-attention model, no async scheduling, no drafts, no cache salts, no stop tokens, no EOS, no min_tokens, no
model runner)."""

from __future__ import annotations

import random
from typing import Any

from kvfuzz.scheduler.swarm import DIMENSIONS, MODEL_RUNNER, Dimension


def _uniform(rng: random.Random, values: tuple[Any, ...]) -> Any:
    return rng.choice(values)


_SHARED = ("num_blocks", "max_num_batched_tokens", "max_num_seqs", "prefix_caching")

SGLANG_DIMENSIONS: tuple[Dimension, ...] = (
    *(dimension for dimension in DIMENSIONS if dimension.name in _SHARED),
    Dimension("block_size", (2, 4, 8, 16), _uniform),
    Dimension("policy", ("fcfs",), _uniform),
    Dimension("model", ("full",), _uniform),
    Dimension("async_scheduling", (False,), _uniform),
    Dimension("speculative_tokens", (0,), _uniform),
    Dimension("cache_salts", (False,), _uniform),
    Dimension("stop_tokens", (False,), _uniform),
    Dimension("eos", (False,), _uniform),
    Dimension("min_tokens", (False,), _uniform),
    Dimension(MODEL_RUNNER, ("",), _uniform),
)
"""SGLang's configuration, one row per dimension (every row of vLLM's table, by name)."""
