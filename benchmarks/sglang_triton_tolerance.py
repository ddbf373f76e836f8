"""The margin of the ``sglang-triton`` kernel (held to kvfuzz.kernels.base.DIFFERENT_KERNEL_TOLERANCE), measured.

Runs SGLang's Triton decode and extend attention (through kvfuzz's kernel, so through the inputs it builds) on random
batches and prints, per pool dtype and per SGLang kernel, the largest absolute difference from kvfuzz's reference
(the gather kernel: the reference's own ``attend`` on the gathered K/V). Batches vary what the kernels tile: block
size, scattered block tables, sliding windows (blocks wholly before the window's start are null), GQA group sizes,
head dims and lengths past the decode kernel's 32-token splits. Runs in the SGLang environment
(scripts/third_party_env.sh sglang); on CPU, in Triton's interpreter (about a second a batch).

Usage: python benchmarks/sglang_triton_tolerance.py [--batches N] [--seed S]
"""

from __future__ import annotations

import argparse
import random

import torch

from kvfuzz.allocator.types import NULL_BLOCK
from kvfuzz.kernels import PagedBatch, make_kernel, prepare_kernel
from kvfuzz.kernels.gather import GatherKernel
from kvfuzz.kernels.sglang_triton import uses_extend
from kvfuzz.reference.content import ModelShape

HEADS = [(1, 1), (2, 4), (1, 8), (4, 4)]  # (KV heads, query heads): MHA, GQA 2 and 8, MHA with 4 heads


def random_batch(rng: random.Random, dtype: torch.dtype) -> PagedBatch:
    """1 to 4 rows of up to 80 positions through scattered tables, a third of them under a sliding window."""
    kv_heads, query_heads = rng.choice(HEADS)
    layers, dim, size = rng.randint(1, 2), rng.choice([8, 16, 64]), rng.choice([1, 4, 16])
    lengths = [rng.randint(1, 80) for _ in range(rng.randint(1, 4))]
    needed = [-(-length // size) for length in lengths]
    blocks = list(range(sum(needed) + rng.randint(0, 4)))
    rng.shuffle(blocks)
    tables, starts = [], []
    for length, count in zip(lengths, needed):
        table, blocks = blocks[:count], blocks[count:]
        start = max(0, length - rng.randint(1, 24)) if rng.random() < 0.3 else 0
        tables.append([NULL_BLOCK if (index + 1) * size <= start else block for index, block in enumerate(table)])
        starts.append(start)
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    pool = (len(blocks) + sum(needed)) * size

    def uniform(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=generator) * 2 - 1).to(dtype)

    return PagedBatch(
        [f"s{row}" for row in range(len(lengths))],
        tables,
        starts,
        lengths,
        uniform(len(lengths), layers, query_heads, dim),
        uniform(pool, layers, kv_heads, dim),
        uniform(pool, layers, kv_heads, dim),
        size,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20, help="random batches per dtype (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    prepare_kernel("sglang-triton", ModelShape())  # Triton's interpreter on CPU, chosen before SGLang loads
    print(f"{'dtype':<8} {'kernel':<7} {'rows':>5} {'max abs diff':>13}  allowed")
    for dtype in (torch.float32, torch.float16):
        kernel = make_kernel("sglang-triton", None, ModelShape(dtype=dtype))  # type: ignore[arg-type]
        worst = {"decode": 0.0, "extend": 0.0}
        rows = {"decode": 0, "extend": 0}
        for _ in range(args.batches):
            batch = random_batch(rng, dtype)
            difference = (kernel.attend(batch).float() - GatherKernel().attend(batch)).abs()
            for row, length in enumerate(batch.lengths):
                which = "extend" if uses_extend(length) else "decode"
                worst[which] = max(worst[which], float(difference[row].max()))
                rows[which] += 1
        for which in ("decode", "extend"):
            name = str(dtype).removeprefix("torch.")
            print(f"{name:<8} {which:<7} {rows[which]:>5} {worst[which]:>13.3g}  {kernel.tolerance(dtype)}")


if __name__ == "__main__":
    main()
