"""The model a scheduler target's engine serves, as its KV cache sees it: which layers it has and what kind of
KV-cache group each gets. vLLM builds the ``KVCacheConfig`` from these layers itself
(:mod:`kvfuzz.scheduler.vllm_build`); this module only says what the model is, without importing vLLM.

* ``full``: a two-layer llama, every layer full attention: one KV-cache group (the target's first model).
* ``sliding-window``: a four-layer Gemma 2, whose layers alternate a sliding window of ``2 x block size`` tokens and
  full attention: vLLM's hybrid allocator gives it two KV-cache groups sharing one block pool, and the
  sliding-window group's manager drops (frees, and nulls in the tables) the blocks that fell out of the window.
* ``chunked-local``: a two-layer Llama 4 text model, a layer of chunked local attention (each token attends its own
  chunk of ``2 x block size`` tokens) then one of full attention (Llama 4 has three local layers to a global one;
  vLLM's planner would make four KV-cache groups of them, one layer each): two KV-cache groups sharing one block
  pool, and the chunked group's manager drops the blocks wholly before the chunk a request's next token is in.
* ``sliding-window-groups``: a three-layer Gemma 2, two sliding-window layers (a window of ``2 x block size``
  tokens) and a full-attention layer: vLLM's planner makes a group of each layer (its group size is the fewest
  layers of a kind), so three KV-cache groups share the pool, two of them of one sliding-window spec, which vLLM's
  coordinator looks up together (the n:1 pattern of Gemma 3 and gpt-oss, in small).
* ``rswa``: a two-layer llama whose layers are R-SWA (reference sliding window attention: the prompt stays visible,
  generated tokens attend a window of ``2 x block size`` tokens besides): one KV-cache group, whose manager frees the
  blocks in the gap between the prompt and the window as a request decodes.
* ``mamba-hybrid``: a two-layer Jamba, a Mamba layer then a full-attention layer: two KV-cache groups sharing one
  block pool, a Mamba group beside the attention group: without prefix caching its table holds one state block per
  request (``mamba_cache_mode="none"``: its block spans the whole model length); with prefix caching vLLM's
  ``align`` mode keeps a state per block of the pool's block size.

Invariant: the longest request (:func:`max_model_len`) is one vLLM's own startup check admits on the pool: every
group's blocks for a request of that length fit in the usable blocks together (each group counted: vLLM's planner
splits each kind's layers into groups of one size, :func:`group_counts`)."""

from __future__ import annotations

from collections import Counter
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

    def layer_kinds(self) -> Counter[str]:
        """Layers of each kind (``full``, ``sliding``; the subclasses add theirs), as vLLM's planner buckets them."""
        return Counter("full" if blocks is None else "sliding" for blocks in self.window_blocks)

    def groups_of(self, kind: str) -> int:
        """KV-cache groups vLLM's planner makes of the layers of ``kind`` (:func:`group_counts`)."""
        return group_counts(self.layer_kinds()).get(kind, 0)

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
        group's ``ceil(length / block_size)``, and every sliding-window group's admission cap (its window less one,
        and the tokens in flight, ``budget``, at most ``length``, in blocks, plus one)."""
        window = self.sliding_window(block_size)
        full = self.groups_of("full") * -(-length // block_size)
        if window is None:
            return full
        return full + self.groups_of("sliding") * (-(-min(window - 1 + budget, length) // block_size) + 1)


@attrs.frozen
class ChunkedLocalModel(SchedulerModel):
    """A Llama 4 text model: ``local_layers`` layers of chunked local attention (chunks of ``chunk_blocks`` blocks'
    tokens), then full-attention layers as ``window_blocks`` says (full attention only)."""

    local_layers: int = 1  # chunked local attention layers, before the full-attention ones
    chunk_blocks: int = 2  # the attention chunk, in blocks

    def attention_chunk(self, block_size: int) -> int:
        """The attention chunk in tokens."""
        return self.chunk_blocks * block_size

    def hf_config(self, shape: ModelShape, block_size: int) -> dict[str, Any]:
        return super().hf_config(shape, block_size) | {
            "num_hidden_layers": self.local_layers + len(self.window_blocks),
            "attention_chunk_size": self.attention_chunk(block_size),
        }

    def layer_kinds(self) -> Counter[str]:
        return super().layer_kinds() + Counter({"chunked": self.local_layers})

    def blocks_per_request(self, length: int, block_size: int, budget: int) -> int:
        """Full attention's blocks, and each chunked group's admission cap (a chunk and the tokens in flight, at most
        ``length``, in blocks: vLLM's ``ChunkedLocalAttentionSpec.max_admission_blocks_per_request``)."""
        chunked = -(-min(self.attention_chunk(block_size) + budget, length) // block_size)
        return super().blocks_per_request(length, block_size, budget) + self.groups_of("chunked") * chunked


@attrs.frozen
class MambaHybridModel(SchedulerModel):
    """A Jamba: ``mamba_layers`` Mamba layers, then attention layers as ``window_blocks`` says (full attention
    only). Its Mamba state is small (``mamba_d_state`` 1, ``mamba_d_conv`` 2: 64 bytes a layer) so that its page
    fits the attention page of any block size, as vLLM's planner needs (it pads the Mamba page to the attention one).

    Invariant: a request holds at most two resident blocks of the Mamba group (its state, and in ``align`` mode the
    previous state until the next step), so the startup check reserves two blocks more than full attention's."""

    mamba_layers: int = 1  # Mamba layers, before the attention layers

    def hf_config(self, shape: ModelShape, block_size: int) -> dict[str, Any]:
        layers = self.mamba_layers + len(self.window_blocks)
        return super().hf_config(shape, block_size) | {
            "num_hidden_layers": layers,
            "attn_layer_period": layers,
            "attn_layer_offset": self.mamba_layers,
            "expert_layer_period": layers,
            "expert_layer_offset": self.mamba_layers,
            "num_experts": 1,
            "mamba_d_state": 1,
            "mamba_d_conv": 2,
            "mamba_expand": 1,
            "mamba_dt_rank": 1,
        }

    def layer_kinds(self) -> Counter[str]:
        return super().layer_kinds() + Counter({"mamba": self.mamba_layers})

    def blocks_per_request(self, length: int, block_size: int, budget: int) -> int:
        """Full attention's blocks, and each Mamba group's most resident blocks: one state block without prefix
        caching, two in ``align`` mode (vLLM's ``MambaSpec.max_memory_usage_bytes``); two for both."""
        return super().blocks_per_request(length, block_size, budget) + 2 * self.groups_of("mamba")


@attrs.frozen
class RSWAModel(SchedulerModel):
    """A llama whose layers are R-SWA layers (vLLM's ``RSWAAttention``: a full-attention layer whose KV-cache spec is
    an ``RSWASpec``), with a window of ``rswa_blocks`` blocks' tokens: ``window_blocks`` counts the layers.

    Invariant: a request's blocks are at most full attention's (vLLM sizes R-SWA as full attention: the gap it frees
    is decode tokens', unknown at admission), so the startup check reserves ``ceil(length / block_size)`` each."""

    rswa_blocks: int = 2  # the window generated tokens attend, in blocks

    def rswa_window(self, block_size: int) -> int:
        """The R-SWA window in tokens."""
        return self.rswa_blocks * block_size

    def layer_kinds(self) -> Counter[str]:
        return Counter({"rswa": len(self.window_blocks)})

    def blocks_per_request(self, length: int, block_size: int, budget: int) -> int:
        return self.groups_of("rswa") * -(-length // block_size)


CHECKPOINT_BLOCKS = 1
"""The prefill checkpoint blocks a Mamba2 layer's spec asks for (vLLM's ``MambaMixer2.get_kv_cache_spec``), where
the Mamba layers export checkpoints (:mod:`kvfuzz.scheduler.mamba_checkpoints`)."""

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
SLIDING_WINDOW_GROUPS = SchedulerModel(
    "sliding-window-groups",
    "a three-layer Gemma 2, two layers of a sliding window of 2 blocks' tokens and one of full attention (three "
    "KV-cache groups, two of one sliding-window spec)",
    "Gemma2ForCausalLM",
    "gemma2",
    (2, 2, None),
)
MAMBA_HYBRID = MambaHybridModel(
    "mamba-hybrid",
    "a two-layer Jamba, a Mamba layer beside a full-attention layer (a Mamba group and an attention group)",
    "JambaForCausalLM",
    "jamba",
    (None,),
)
CHUNKED_LOCAL = ChunkedLocalModel(
    "chunked-local",
    "a two-layer Llama 4 text model, a layer of chunked local attention (chunks of 2 blocks' tokens) and one of full "
    "attention (two KV-cache groups)",
    "LlamaForCausalLM",
    "llama",
    (None,),
)
RSWA = RSWAModel(
    "rswa",
    "a two-layer llama of R-SWA layers, the prompt kept and a window of 2 blocks' tokens of generated ones (one "
    "KV-cache group)",
    "LlamaForCausalLM",
    "llama",
    (None, None),
)
MODELS = {
    model.name: model for model in (FULL, SLIDING_WINDOW, MAMBA_HYBRID, CHUNKED_LOCAL, SLIDING_WINDOW_GROUPS, RSWA)
}
"""The models ``kvfuzz run --scheduler --model`` takes."""


def group_counts(layers: Counter[str]) -> dict[str, int]:
    """The KV-cache groups vLLM's planner makes of a hybrid model's layers, per kind (``get_kv_cache_groups``): it
    splits every kind's layers into groups of one size, the fewest layers of a kind (the "1" of an n:1 pattern), or
    the most where no kind has half again as many as the fewest (12 sliding-window layers beside 13 full-attention
    ones make one group of each, padded); a kind of ``n`` layers makes ``ceil(n / size)`` groups."""
    counts = [count for count in layers.values() if count]
    if not counts:
        return {}
    size = max(counts) if max(counts) < min(counts) * 1.5 else min(counts)
    return {kind: -(-count // size) for kind, count in layers.items() if count}


def max_model_len(
    model: SchedulerModel, num_blocks: int, block_size: int, budget: int, checkpoint_blocks: int = 0
) -> int:
    """The longest request the target is given: the whole pool for full attention; for a hybrid model, the longest
    (in whole blocks) whose blocks in every group fit the pool together, as vLLM's startup check asks (0 if none);
    ``checkpoint_blocks``: a Mamba group's prefill checkpoint blocks besides (``MambaSpec.max_memory_usage_bytes``
    counts them)."""
    for blocks in range(num_blocks, 0, -1):
        if model.blocks_per_request(blocks * block_size, block_size, budget) + checkpoint_blocks <= num_blocks:
            return blocks * block_size
    return 0
