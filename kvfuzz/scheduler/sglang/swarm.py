"""The swarm table of ``kvfuzz campaign --scheduler sglang``: vLLM's rows (:data:`kvfuzz.scheduler.swarm.DIMENSIONS`)
where SGLang's target takes the same option, and its own where it differs: pages of at least 2 tokens (SGLang
serves page size 1 with another allocator), and one value for what the SGLang target does not drive (FCFS, the
full-attention model, no async scheduling, no drafts, no cache salts, no stop tokens, no model runner)."""

from __future__ import annotations

from kvfuzz.scheduler.swarm import DIMENSIONS, MODEL_RUNNER, Dimension

_SHARED = ("num_blocks", "max_num_batched_tokens", "max_num_seqs", "prefix_caching")

SGLANG_DIMENSIONS: tuple[Dimension, ...] = (
    *(dimension for dimension in DIMENSIONS if dimension.name in _SHARED),
    Dimension("block_size", lambda rng: rng.choice((2, 4, 8, 16))),
    Dimension("policy", lambda rng: "fcfs"),
    Dimension("model", lambda rng: "full"),
    Dimension("async_scheduling", lambda rng: False),
    Dimension("speculative_tokens", lambda rng: 0),
    Dimension("cache_salts", lambda rng: False),
    Dimension("stop_tokens", lambda rng: False),
    Dimension(MODEL_RUNNER, lambda rng: ""),
)
"""SGLang's configuration, one row per dimension (every row of vLLM's table, by name)."""
