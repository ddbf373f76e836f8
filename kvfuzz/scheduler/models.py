"""The model a scheduler target's engine serves, as its KV cache sees it: which layers it has and what kind of
KV-cache group each gets. vLLM builds the ``KVCacheConfig`` from these layers itself
(:mod:`kvfuzz.scheduler.vllm_build`); this module only says what the model is, without importing vLLM.

* ``full``: a two-layer llama, every layer full attention: one KV-cache group (the target's first model).
* ``sliding-window``: a four-layer Gemma 2, whose layers alternate a sliding window of ``2 x block size`` tokens and
  full attention: vLLM's hybrid allocator gives it two KV-cache groups sharing one block pool, and the
  sliding-window group's manager drops (frees, and nulls in the tables) the blocks that fell out of the window.

Invariant: the longest request (:func:`max_model_len`) is one vLLM's own startup check admits on the pool: every
group's blocks for a request of that length fit in the usable blocks together."""

from __future__ import annotations

from typing import Any, Optional

import attrs

from kvfuzz.reference.content import ModelShape


@attrs.frozen
class SchedulerModel:
    """One model kvfuzz writes a ``config.json`` for: its layers' kinds (``None`` full attention, an integer a
    sliding window of that many blocks' tokens)."""

    name: str  # the name ``--model`` takes
    description: str  # for a person
    architecture: str  # the Hugging Face architecture
    model_type: str  # the Hugging Face model type
    window_blocks: tuple[Optional[int], ...]  # per layer: None (full attention) or the window in blocks

    def sliding_window(self, block_size: int) -> Optional[int]:
        """The sliding window in tokens (one window for the model), or None if it has none."""
        windows = {blocks for blocks in self.window_blocks if blocks is not None}
        return None if not windows else max(windows) * block_size

    def hf_config(self, shape: ModelShape, block_size: int) -> dict[str, Any]:
        """The ``config.json`` of the model."""
        config: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_size": shape.num_query_heads * shape.head_dim,
            "intermediate_size": 16,
            "num_attention_heads": shape.num_query_heads,
            "num_key_value_heads": shape.num_kv_heads,
            "num_hidden_layers": len(self.window_blocks),
            "vocab_size": 64,
            "max_position_embeddings": 1 << 16,
            "torch_dtype": "float32",
            "rms_norm_eps": 1e-5,
        }
        window = self.sliding_window(block_size)
        if window is not None:
            config |= {
                "head_dim": shape.head_dim,
                "sliding_window": window,
                "query_pre_attn_scalar": shape.head_dim,
                "layer_types": ["full_attention" if b is None else "sliding_attention" for b in self.window_blocks],
            }
        return config

    def blocks_per_request(self, length: int, block_size: int, budget: int) -> int:
        """Usable blocks vLLM's startup check reserves for one request of ``length`` tokens: every full-attention
        group's ``ceil(length / block_size)``, and a sliding-window group's admission cap (its window less one, and
        the tokens in flight, ``budget``, at most ``length``, in blocks, plus one)."""
        window = self.sliding_window(block_size)
        full = -(-length // block_size)
        if window is None:
            return full
        return full + -(-min(window - 1 + budget, length) // block_size) + 1


FULL = SchedulerModel(
    "full", "a two-layer llama, full attention (one KV-cache group)", "LlamaForCausalLM", "llama", (None, None)
)
SLIDING_WINDOW = SchedulerModel(
    "sliding-window",
    "a four-layer Gemma 2 alternating a sliding window of 2 blocks' tokens and full attention (two KV-cache groups)",
    "Gemma2ForCausalLM",
    "gemma2",
    (2, None, 2, None),
)
MODELS = {model.name: model for model in (FULL, SLIDING_WINDOW)}
"""The models ``kvfuzz run --scheduler --model`` takes."""


def max_model_len(model: SchedulerModel, num_blocks: int, block_size: int, budget: int) -> int:
    """The longest request the target is given: the whole pool for full attention; for a hybrid model, the longest
    (in whole blocks) whose blocks in every group fit the pool together, as vLLM's startup check asks (0 if none)."""
    for blocks in range(num_blocks, 0, -1):
        if model.blocks_per_request(blocks * block_size, block_size, budget) <= num_blocks:
            return blocks * block_size
    return 0
