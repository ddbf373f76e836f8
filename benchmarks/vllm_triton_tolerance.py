"""The tolerance of the ``vllm-triton`` kernel (vLLM's Triton unified attention), measured.

Runs the kernel on random batches (scattered block tables, sliding-window starts, KV-cache groups of smaller blocks,
grouped queries, block sizes 4 and 16) and prints, per pool dtype, the largest absolute difference from kvfuzz's
contiguous reference (the gather kernel, equal to it bit for bit) beside the tolerance the kernel is held to. Runs in
the vLLM environment (scripts/third_party_env.sh vllm); on CPU, under Triton's interpreter.

Usage: python benchmarks/vllm_triton_tolerance.py [--batches N] [--seed S] [--split-kv]
"""

from __future__ import annotations

import argparse
import random

import torch

from kvfuzz.kernels import GatherKernel, PagedBatch, different_kernel_tolerance, prepare_kernel
from kvfuzz.reference.content import ModelShape

DTYPES = (torch.float32, torch.float16)


def random_batch(shape: ModelShape, rng: random.Random) -> PagedBatch:
    """Up to 5 rows over a pool of shuffled blocks; some rows start after 0 (a window), some hold fewer tokens per
    block than the pools' rows (a KV-cache group of smaller blocks)."""
    rows_per_block = rng.choice([4, 16])
    num_blocks = 24
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs, tables, starts, lengths, sizes = [], [], [], [], []
    for row in range(rng.randint(1, 5)):
        size = rng.choice([rows_per_block, rows_per_block // 2])
        length = rng.randint(1, 4 * size)
        blocks = -(-length // size)
        if blocks > len(free):
            break
        table = [free.pop() for _ in range(blocks)]
        start = rng.randint(1, length - 1) if length > 1 and rng.random() < 0.4 else 0
        seqs.append(f"s{row}")
        tables.append(table)
        starts.append(start)
        lengths.append(length)
        sizes.append(size)
    pool = (num_blocks * rows_per_block, *shape.kv_row_shape)
    keys = (torch.rand(pool) * 2 - 1).to(shape.dtype)
    values = (torch.rand(pool) * 2 - 1).to(shape.dtype)
    queries = (torch.rand(len(seqs), shape.num_layers, shape.num_query_heads, shape.head_dim) * 2 - 1).to(shape.dtype)
    return PagedBatch(seqs, tables, starts, lengths, queries, keys, values, rows_per_block, sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=40, help="random batches per dtype (default 40)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split-kv", action="store_true", help="vLLM's split-KV decode path (slower)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    for dtype in DTYPES:
        shape_of = {
            group: ModelShape(num_layers=2, num_kv_heads=2, num_query_heads=2 * group, head_dim=8, dtype=dtype)
            for group in (1, 3)
        }
        prepare_kernel("vllm-triton", shape_of[1])
        from kvfuzz.kernels.vllm_triton import VllmTritonKernel

        worst = 0.0
        for _ in range(args.batches):
            shape = shape_of[rng.choice([1, 3])]
            batch = random_batch(shape, rng)
            expected = GatherKernel().attend(batch)
            paged = VllmTritonKernel(shape, split_kv=args.split_kv).attend(batch)
            worst = max(worst, float((paged.float() - expected).abs().max()))
        print(
            f"{str(dtype).removeprefix('torch.'):8} {args.batches} batches: max abs difference {worst:.3g} "
            f"(held to {different_kernel_tolerance(dtype)})"
        )


if __name__ == "__main__":
    main()
