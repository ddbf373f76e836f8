"""Constructed workloads: synthetic request streams made by seeded generators, labelled ``origin: constructed``.

They are shapes worth testing against, not measurements of any real service: uniform traffic, a long tail of output
lengths, a shared system prompt with parallel sampling, and heavy cancellation. The files in
``workloads/constructed/`` are exactly what these generators write (a test keeps them so).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

from kvfuzz.workload.format import FORMAT, Workload, parse_workload


def _request(
    generator: random.Random, number: int, arrival: int, prompt: tuple[int, int], output: int, **extra: object
) -> dict:
    return {
        "id": f"r{number}",
        "arrival": arrival,
        "prompt_len": generator.randint(*prompt),
        "output_len": output,
        **extra,
    }


def uniform(seed: int = 0) -> dict:
    generator = random.Random(seed)
    requests = [_request(generator, n, n // 2, (8, 40), generator.randint(4, 24)) for n in range(48)]
    return {
        "name": "uniform",
        "description": "48 requests, two arriving per step, prompts of 8-40 tokens, outputs of 4-24 tokens",
        "requests": requests,
    }


def long_tail(seed: int = 0) -> dict:
    generator = random.Random(seed)
    requests = []
    for n in range(40):
        output = min(240, max(2, int(generator.lognormvariate(2.5, 0.9))))
        requests.append(_request(generator, n, n, (4, 64), output))
    return {
        "name": "long-tail",
        "description": "40 requests, one per step, log-normal output lengths (median "
        "about 12 tokens, a few past 100, capped at 240): long requests hold blocks while short ones churn",
        "requests": requests,
    }


def shared_system_prompt(seed: int = 0) -> dict:
    generator = random.Random(seed)
    requests = [
        _request(
            generator,
            n,
            n,
            (2, 16),
            generator.randint(4, 20),
            prefix_group="system",
            **({"samples": 2} if n % 4 == 0 else {}),
        )
        for n in range(36)
    ]
    return {
        "name": "shared-system-prompt",
        "description": "36 requests, one per step, each a 48-token system "
        "prompt followed by 2-16 tokens of its own; every fourth asks for 2 parallel samples",
        "prefix_groups": {"system": {"length": 48}},
        "requests": requests,
    }


def heavy_cancellation(seed: int = 0) -> dict:
    generator = random.Random(seed)
    requests = []
    for n in range(48):
        arrival = n // 2
        extra = {}
        if (
            generator.random() < 0.5
        ):  # half are cancelled: on arrival (admitted, then aborted before its first step), or a few steps in
            extra["cancel_at"] = arrival + generator.choice((0, 0, 1, 1, 2, 3, 5, 8, 13))
        requests.append(_request(generator, n, arrival, (8, 48), generator.randint(8, 40), **extra))
    return {
        "name": "heavy-cancellation",
        "description": "48 requests, two per step; half are cancelled 0-13 steps "
        "after arriving (before admission, during prefill, or mid-decode)",
        "requests": requests,
    }


GENERATORS: dict[str, Callable[[int], dict]] = {
    "uniform": uniform,
    "long-tail": long_tail,
    "shared-system-prompt": shared_system_prompt,
    "heavy-cancellation": heavy_cancellation,
}


def constructed_json(name: str, seed: int = 0) -> dict:
    """The JSON object of constructed workload ``name``."""
    if name not in GENERATORS:
        raise KeyError(f"no constructed workload named {name!r}; known: {', '.join(GENERATORS)}")
    body = GENERATORS[name](seed)
    return {
        "format": FORMAT,
        "name": body["name"],
        "origin": "constructed",
        "provenance": {"kind": "constructed", "generator": f"kvfuzz.workload.constructed:{name}", "seed": seed},
        "description": body["description"],
        "prefix_groups": body.get("prefix_groups", {}),
        "requests": body["requests"],
    }


def constructed(name: str, seed: int = 0) -> Workload:
    return parse_workload(constructed_json(name, seed), f"constructed:{name}")


def write_constructed(directory: Path) -> list[Path]:
    """Write every constructed workload as ``NAME.json`` into ``directory``; returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in GENERATORS:
        path = directory / f"{name}.json"
        path.write_text(json.dumps(constructed_json(name), indent=1) + "\n")
        paths.append(path)
    return paths
