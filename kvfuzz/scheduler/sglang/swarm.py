"""The swarm table of ``kvfuzz campaign --scheduler sglang``: vLLM's rows (:data:`kvfuzz.scheduler.swarm.DIMENSIONS`)
where SGLang's target takes the same option, and its own where it differs: pages of at least 2 tokens (SGLang
serves page size 1 with another allocator), and one value for what the SGLang target does not drive (FCFS, the
full-attention model, no async scheduling, no drafts, no cache salts, no stop tokens, no min_tokens, no KV
connector, no model runner, no LoRA); and its own rows for EOS (requests that do not ignore it, half the batches)
and the schedule conservativeness, which together make decode run out of pages and retract."""

from __future__ import annotations

from kvfuzz.scheduler.swarm import DIMENSIONS, MODEL_RUNNER
from kvfuzz.swarm_table import Dimension, fixed, uniform

_SHARED = ("num_blocks", "max_num_batched_tokens", "max_num_seqs", "prefix_caching")

SGLANG_DIMENSIONS: tuple[Dimension, ...] = (
    *(dimension for dimension in DIMENSIONS if dimension.name in _SHARED),
    Dimension("block_size", (2, 4, 8, 16), uniform),
    Dimension("policy", ("fcfs",), fixed),
    Dimension("model", ("full",), fixed),
    Dimension("async_scheduling", (False,), fixed),
    Dimension("speculative_tokens", (0,), fixed),
    Dimension("cache_salts", (False,), fixed),
    Dimension("stop_tokens", (False,), fixed),
    Dimension("eos", (False, True), uniform),  # requests ending at EOS (retraction)
    Dimension("min_tokens", (False,), fixed),
    Dimension("kv_connector", ("none",), fixed),
    Dimension("transfer_delay", (0,), fixed),
    Dimension("load_failures", (False,), fixed),
    Dimension("max_loras", (0,), fixed),
    Dimension("prefix_resets", (False,), fixed),
    Dimension("kv_events", (False,), fixed),
    Dimension("overlong_requests", (False,), fixed),
    Dimension("stats", (False,), fixed),
    Dimension("prefix_match_unit", (0,), fixed),
    Dimension("sessions", (False,), fixed),
    # the new-token ratio's start (0.7 x it): below 1 the PrefillAdder overcommits running requests' outputs, and
    # decode retracts (with EOS drawn: an ignore_eos request's remaining output is reserved in full)
    Dimension("schedule_conservativeness", (1.0, 0.3, 0.1), uniform),
    Dimension("drafter", ("ngram",), fixed),
    Dimension("kv_events_full", (False,), fixed),
    Dimension("long_prefill_token_threshold", (0,), fixed),
    Dimension("long_prefill_token_threshold_adaptive", (False,), fixed),
    Dimension("max_num_active_seqs", (0,), fixed),
    Dimension("prefill_schedule_interval", (1,), fixed),
    Dimension("pauses", (False,), fixed),
    Dimension("load_failure_policy", ("recompute",), fixed),
    Dimension("skip_prefix_reads", (False,), fixed),
    Dimension("retention", ("semantic",), fixed),
    Dimension("chunked_prefill", (True,), fixed),
    Dimension("mamba_checkpoints", (False,), fixed),
    Dimension(MODEL_RUNNER, ("",), fixed),
)
"""SGLang's configuration, one row per dimension (every row of vLLM's table, by name)."""
