"""Attention of one query per sequence over that sequence's K/V, batched with padding.

The same function serves the contiguous reference and the paged path, so on equal inputs the results are equal bit
for bit. Padded positions must hold zeros in both; the mask removes them from the softmax.
"""

from __future__ import annotations

import torch


def attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention of the last token of each sequence.

    queries ``[S, L, Hq, D]``; keys and values ``[S, N, L, Hkv, D]`` padded to N positions; lengths ``[S]``.
    Returns ``[S, L, Hq, D]`` in float32.
    """
    num_seqs, max_len, num_layers, kv_heads, head_dim = keys.shape
    group = queries.shape[2] // kv_heads
    # Query head h reads KV head h // group: the queries of one KV head side by side, [S, L, Hkv, group, D].
    q = queries.float().reshape(num_seqs, num_layers, kv_heads, group, head_dim)
    k = keys.float().permute(0, 2, 3, 4, 1)  # [S, L, Hkv, D, N]
    v = values.float().permute(0, 2, 3, 1, 4)  # [S, L, Hkv, N, D]
    scores = torch.matmul(q, k) * head_dim**-0.5  # [S, L, Hkv, group, N]
    valid = torch.arange(max_len, device=keys.device).unsqueeze(0) < lengths.to(keys.device).unsqueeze(1)
    scores = scores.masked_fill(~valid[:, None, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).reshape(num_seqs, num_layers, group * kv_heads, head_dim)
