"""A tiny decoder-only transformer with random weights fixed by a seed, built from a config: no download.

Pre-norm blocks (RMS norm without parameters), multi-head causal attention, a ReLU MLP, learned position
embeddings, tied output weights; float32 on the CPU. The model never holds K/V itself: :meth:`TinyLM.forward_token`
computes one token at one position and hands each layer's key and value to a :class:`KVStore`, then reads back the
keys and values of every earlier position of the sequence from it. Computing one token per call keeps every matrix
product the same shape whatever the store, so two stores holding equal K/V give bit-identical logits.
"""

from __future__ import annotations

from typing import Protocol

import attrs
import torch


@attrs.frozen
class TinyConfig:
    """The model's shape and the seed its weights are drawn from."""

    vocab: int = 64  # tokens 0 .. vocab - 1
    layers: int = 2  # transformer blocks
    heads: int = 2  # attention heads per block
    head_dim: int = 8  # width of each head
    mlp: int = 32  # hidden width of the MLP
    max_positions: int = 256  # positions the position embedding covers
    seed: int = 0  # draws every weight

    @property
    def width(self) -> int:
        return self.heads * self.head_dim


class KVStore(Protocol):
    """Where a sequence's keys and values live: ``write`` position ``position``'s ``[heads, head_dim]`` key and
    value of layer ``layer``; ``read`` returns the ``[length, heads, head_dim]`` keys and values of positions
    ``0 .. length - 1``."""

    def write(self, layer: int, position: int, key: torch.Tensor, value: torch.Tensor) -> None: ...

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class TinyLM:
    """The model: weights drawn from ``config.seed``, one token at a time through a :class:`KVStore`."""

    def __init__(self, config: TinyConfig) -> None:
        self.config = config
        generator = torch.Generator().manual_seed(config.seed)
        width = config.width

        def draw(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator) / shape[0] ** 0.5

        self.embedding = torch.randn(config.vocab, width, generator=generator)  # token embeddings, tied output
        self.positions = torch.randn(config.max_positions, width, generator=generator) * 0.5  # position embeddings
        self.blocks = [
            {name: draw(width, width) for name in ("q", "k", "v", "o")}
            | {"up": draw(width, config.mlp), "down": draw(config.mlp, width)}
            for _ in range(config.layers)
        ]  # per layer: query, key, value, output projections and the MLP's two matrices

    @torch.no_grad()
    def forward_token(self, token: int, position: int, store: KVStore) -> torch.Tensor:
        """The ``[vocab]`` logits after ``token`` at ``position``; writes its K/V to ``store`` and reads the
        sequence's earlier K/V from it."""
        config = self.config
        if not 0 <= position < config.max_positions:
            raise ValueError(f"position {position} is outside the model's {config.max_positions} positions")
        x = self.embedding[token] + self.positions[position]
        for layer, block in enumerate(self.blocks):
            h = _rms(x)
            q = (h @ block["q"]).view(config.heads, config.head_dim)
            store.write(
                layer, position, (h @ block["k"]).view(config.heads, -1), (h @ block["v"]).view(config.heads, -1)
            )
            keys, values = store.read(layer, position + 1)
            scores = torch.einsum("hd,thd->ht", q, keys) / config.head_dim**0.5
            attended = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), values)
            x = x + attended.reshape(-1) @ block["o"]
            x = x + torch.relu(_rms(x) @ block["up"]) @ block["down"]
        return _rms(x) @ self.embedding.T


class ContiguousKV:
    """One sequence's K/V in contiguous tensors ``[layers, max_positions, heads, head_dim]``: the reference."""

    def __init__(self, config: TinyConfig) -> None:
        shape = (config.layers, config.max_positions, config.heads, config.head_dim)
        self.keys, self.values = torch.zeros(shape), torch.zeros(shape)

    def write(self, layer: int, position: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.keys[layer, position], self.values[layer, position] = key, value

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer, :length], self.values[layer, :length]
