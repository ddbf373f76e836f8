"""The machine and pool arguments that ``kvfuzz run`` and ``kvfuzz zoo`` share, and the configuration they give."""

from __future__ import annotations

import argparse

from kvfuzz.engine.config import MachineConfig
from kvfuzz.reference.content import ModelShape
from kvfuzz.trace import DTYPES


def machine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("machine")
    group.add_argument("--examples", type=int, default=100, help="Hypothesis examples to run (default 100)")
    group.add_argument("--steps", type=int, default=50, help="most operations per example (default 50)")
    group.add_argument("--seed", type=int, help="random seed (default: derandomized, the same run every time)")
    group.add_argument("--no-shrink", action="store_true", help="report the first failure as found, unshrunk")
    pool = parser.add_argument_group("pool and model")
    pool.add_argument("--block-size", type=int, default=MachineConfig().block_size)
    pool.add_argument("--num-blocks", type=int, default=MachineConfig().num_blocks)
    pool.add_argument("--host-blocks", type=int, default=MachineConfig().num_host_blocks)
    pool.add_argument("--layers", type=int, default=ModelShape().num_layers)
    pool.add_argument("--kv-heads", type=int, default=ModelShape().num_kv_heads)
    pool.add_argument("--query-heads", type=int, default=ModelShape().num_query_heads)
    pool.add_argument("--head-dim", type=int, default=ModelShape().head_dim)
    pool.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    pool.add_argument("--device", default="cpu", help="torch device of the pools: cpu (default), cuda, cuda:N")


def machine_config(args: argparse.Namespace) -> MachineConfig:
    """The configuration :func:`machine_arguments` parsed; ``ValueError`` where it is inconsistent."""
    shape = ModelShape(args.layers, args.kv_heads, args.query_heads, args.head_dim, DTYPES[args.dtype], args.device)
    return MachineConfig(args.block_size, args.num_blocks, args.host_blocks, shape)
