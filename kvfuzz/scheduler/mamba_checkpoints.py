"""Prefill checkpoints exported from inside the forward pass, as vLLM's Mamba2 mixer exports them
(``SchedulerSetup.mamba_checkpoints``; docs/scheduler-features.md): its ``MambaSpec`` says
``num_prefill_checkpoint_blocks=1`` and ``prefill_checkpoint_alignment=1``, so on a Mamba hybrid with prefix caching
vLLM's scheduler no longer ends a prefill chunk on the prompt's last reusable boundary; instead its Mamba manager
reserves a block for the state at that boundary (``_needs_internal_checkpoint``) and keys it in the prefix cache at
that position (``_cache_partial_tail_block``), and the model runner writes the state there during the chunk.

kvfuzz plays that runner: :func:`checkpoint_rule` is the rule the runner's metadata builder applies to each prefill
row (vLLM's own ``compute_mamba_prefill_checkpoints``, with the token granularities the engine core resolves), and
:class:`~kvfuzz.scheduler.mamba_states.CheckpointingAlignStates` writes the state after the checkpoint's position
into the entry it names. A hit on a checkpoint the scheduler keyed but the rule never had written, or keyed at another
position than the one written, then reads a state that is not its prefix's, and the state check fails."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.mamba_states import CheckpointRule
from kvfuzz.scheduler.models import CHECKPOINT_BLOCKS

CHECKPOINT_ALIGNMENT = 1
"""The token alignment of a Mamba2 checkpoint inside a chunk: any position (vLLM's Mamba2 kernel splits its chunks
there)."""


def checkpoint_spec(spec: Any, setup: SchedulerSetup) -> Any:
    """The Mamba layers' ``MambaSpec`` ``spec``, with prefill checkpoints where ``setup`` asks for them."""
    if not setup.mamba_checkpoints:
        return spec
    return dataclasses.replace(
        spec, num_prefill_checkpoint_blocks=CHECKPOINT_BLOCKS, prefill_checkpoint_alignment=CHECKPOINT_ALIGNMENT
    )


def checkpoint_rule(setup: SchedulerSetup, mamba_block_size: int, cache_hit_alignment_tokens: int) -> CheckpointRule:
    """The runner's rule for where a prefill row exports its checkpoint, where ``setup`` asks for checkpoints: vLLM's
    ``compute_mamba_prefill_checkpoints`` for one row, given the row's sequence length after the step and its query
    length, the prompt's boundary on ``cache_hit_alignment_tokens`` (what the engine core resolves) and its hashes
    every ``setup.hash_block_size`` tokens. No EAGLE block drop (EAGLE is not drawn on a hybrid) and no hash lookahead.
    A one-token query is a decode row, which the runner gives no checkpoint (the rule finds none there either)."""
    from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints

    def rule(seq_len: int, query_len: int) -> Optional[tuple[int, int]]:
        (offset,), (column,) = compute_mamba_prefill_checkpoints(
            [seq_len],
            [query_len],
            hash_block_size=setup.hash_block_size,
            mamba_block_size=mamba_block_size,
            checkpoint_alignment=CHECKPOINT_ALIGNMENT,
            drop_eagle_block=False,
            cache_hit_alignment_tokens=cache_hit_alignment_tokens,
        )
        if column < 0:
            return None
        return seq_len - query_len + offset, column

    return rule
