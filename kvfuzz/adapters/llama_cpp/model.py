"""A tiny llama-architecture model, written as a GGUF file with the ``gguf`` package: no download.

The weights are random (a fixed seed), f32, and small: two layers, 32-wide embeddings, four query heads sharing two
K/V heads, a 16-token vocabulary and no tokenizer (``tokenizer.ggml.model = none``), so kvfuzz's token ids go to
``llama_decode`` as they are. The scale of each matrix keeps the activations and the logits of order one, so a
sequence that attends to one wrong cell gets visibly different logits.
"""

from __future__ import annotations

from pathlib import Path

import attrs


@attrs.frozen
class TinyLlama:
    """The shape of the model written; every field is a llama.cpp hyperparameter."""

    num_layers: int = 2  # llama.block_count
    embedding: int = 32  # llama.embedding_length (n_embd)
    num_heads: int = 4  # llama.attention.head_count
    num_kv_heads: int = 2  # llama.attention.head_count_kv (grouped-query attention)
    feed_forward: int = 64  # llama.feed_forward_length
    vocabulary: int = 16  # llama.vocab_size: ids 0 .. vocabulary - 1, with no tokenizer
    context_train: int = 4096  # llama.context_length: above any context kvfuzz asks for
    seed: int = 20261130  # the weights' random seed

    @property
    def head_dim(self) -> int:
        return self.embedding // self.num_heads


def write_tiny_llama(path: Path, shape: TinyLlama = TinyLlama()) -> Path:
    """Write ``shape`` as a GGUF file at ``path`` (f32 weights drawn from ``shape.seed``) and return ``path``."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(shape.seed)
    n_embd, n_ff, head_dim = shape.embedding, shape.feed_forward, shape.head_dim

    def matrix(rows: int, columns: int) -> "np.ndarray":
        # numpy's shape is ggml's reversed: (rows, columns) is a ggml tensor of ne = [columns, rows], y = W x
        return (rng.standard_normal((rows, columns)) / np.sqrt(columns)).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(shape.context_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocabulary)
    writer.add_tokenizer_model("none")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    ones = np.ones(n_embd, dtype=np.float32)
    writer.add_tensor("token_embd.weight", rng.standard_normal((shape.vocabulary, n_embd)).astype(np.float32))
    for layer in range(shape.num_layers):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", ones)
        writer.add_tensor(f"{block}.attn_q.weight", matrix(head_dim * shape.num_heads, n_embd))
        writer.add_tensor(f"{block}.attn_k.weight", matrix(head_dim * shape.num_kv_heads, n_embd))
        writer.add_tensor(f"{block}.attn_v.weight", matrix(head_dim * shape.num_kv_heads, n_embd))
        writer.add_tensor(f"{block}.attn_output.weight", matrix(n_embd, head_dim * shape.num_heads))
        writer.add_tensor(f"{block}.ffn_norm.weight", ones)
        writer.add_tensor(f"{block}.ffn_gate.weight", matrix(n_ff, n_embd))
        writer.add_tensor(f"{block}.ffn_up.weight", matrix(n_ff, n_embd))
        writer.add_tensor(f"{block}.ffn_down.weight", matrix(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", matrix(shape.vocabulary, n_embd))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
