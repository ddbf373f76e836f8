"""The margin of the llama.cpp adapter's logits check (kvfuzz.adapters.llama_cpp.adapter.LOGITS_TOLERANCE).

Prints, side by side: the largest difference between a decode's logits and a fresh contiguous decode's over random
programs on a clean cache (admits, grows, forks, rollbacks and frees, with and without micro-batches), and the
smallest difference one wrong earlier token makes to the logits of the tiny model. The tolerance must lie between.
Runs in the llama.cpp environment (scripts/third_party_env.sh llama-cpp).

Usage: python benchmarks/llama_cpp_tolerance.py [--programs N] [--prompts N] [--seed S]
"""

from __future__ import annotations

import argparse
import random

from kvfuzz.adapters.llama_cpp import adapter
from kvfuzz.allocator import OutOfBlocks, PoolSpec


def clean_differences(programs: int, rng: random.Random) -> list[float]:
    """Every logits difference the adapter measured over ``programs`` random programs of 60 calls."""
    seen: list[float] = []
    measure = adapter.LlamaCppKVCache._logits_difference

    def recorded(self, tokens, logits):  # type: ignore[no-untyped-def]
        difference = measure(self, tokens, logits)
        seen.append(difference)
        return difference

    adapter.LlamaCppKVCache._logits_difference = recorded  # type: ignore[method-assign]
    for _ in range(programs):
        cache = adapter.LlamaCppKVCache(PoolSpec(1, 64), ubatch=rng.choice([None, 2]))
        live: list[str] = []
        for call in range(60):
            roll = rng.random()
            try:
                if roll < 0.3 or not live:
                    live.append(f"s{call}")
                    cache.admit(live[-1], (), tuple(rng.randrange(4) for _ in range(rng.randint(1, 6))))
                elif roll < 0.6:
                    cache.grow(rng.choice(live), tuple(rng.randrange(4) for _ in range(rng.randint(1, 3))))
                elif roll < 0.75:
                    cache.fork(rng.choice(live), f"s{call}")
                    live.append(f"s{call}")
                elif roll < 0.9:
                    seq = rng.choice(live)
                    if len(cache.block_table(seq)) > 1:
                        cache.rollback(seq, rng.randint(1, len(cache.block_table(seq)) - 1))
                else:
                    seq = rng.choice(live)
                    cache.free(seq)
                    live.remove(seq)
            except OutOfBlocks:
                if roll < 0.3:
                    live.pop()
    adapter.LlamaCppKVCache._logits_difference = measure  # type: ignore[method-assign]
    return seen


def wrong_token_differences(prompts: int, rng: random.Random) -> list[float]:
    """For random prompts of 2..30 tokens, how far the last token's logits move when one earlier token changes."""
    reference = adapter._reference(256)
    differences = []
    for _ in range(prompts):
        tokens = tuple(rng.randrange(4) for _ in range(rng.randint(2, 30)))
        at = rng.randrange(len(tokens) - 1)
        changed = tokens[:at] + ((tokens[at] + rng.randint(1, 3)) % 4,) + tokens[at + 1 :]
        reference.clear()
        right = reference.decode(0, tokens, 0).logits
        reference.clear()
        wrong = reference.decode(0, changed, 0).logits
        differences.append(max(abs(a - b) for a, b in zip(right, wrong)))
    return differences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    clean = clean_differences(args.programs, rng)
    wrong = wrong_token_differences(args.prompts, rng)
    clean_median = sorted(clean)[len(clean) // 2]
    wrong_median = sorted(wrong)[len(wrong) // 2]
    print(f"tolerance                                    {adapter.LOGITS_TOLERANCE:.3g}")
    print(f"clean cache, {len(clean):5d} decodes:    largest  {max(clean):.3g}   median {clean_median:.3g}")
    print(f"one token changed, {len(wrong):4d} prompts: smallest {min(wrong):.3g}   median {wrong_median:.3g}")


if __name__ == "__main__":
    main()
