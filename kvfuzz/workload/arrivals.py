"""A seeded Poisson arrival process: a constructed workload whose requests arrive at a given rate per step.

Inter-arrival gaps are exponential with mean ``1 / rate`` steps (arrival steps are the running sum, rounded down);
each prompt is a shared system prompt followed by a uniformly drawn number of the request's own tokens, and each
output length is drawn uniformly; every ``samples_every``-th request asks for two parallel samples. The same seed
gives the same requests at every rate, arriving in the same order, so a sweep over rates changes only the spacing.
It is labelled constructed: a shape, not a measurement of any service.
"""

from __future__ import annotations

import random

import attrs

from kvfuzz.workload.format import FORMAT, Workload, parse_workload

GENERATOR = "kvfuzz.workload.arrivals:poisson"


@attrs.frozen
class ArrivalShape:
    """What each request of the Poisson process looks like (token counts inclusive)."""

    requests: int = attrs.field(default=60, validator=attrs.validators.ge(1))  # requests in the workload
    system_prompt: int = attrs.field(default=32, validator=attrs.validators.ge(0))  # shared prefix tokens
    own_prompt: tuple[int, int] = (8, 64)  # each request's own prompt tokens, drawn uniformly
    output: tuple[int, int] = (4, 48)  # output tokens, drawn uniformly
    samples_every: int = attrs.field(default=4, validator=attrs.validators.ge(0))  # every n-th asks 2 samples; 0: none

    def longest(self) -> int:
        """The most positions one request can hold: its whole prompt and every output token."""
        return self.system_prompt + self.own_prompt[1] + self.output[1]


def poisson_json(rate: float, seed: int, shape: ArrivalShape = ArrivalShape()) -> dict:
    """The kvfuzz-workload/1 object of the process at ``rate`` requests per step."""
    if not rate > 0:
        raise ValueError(f"the arrival rate must be > 0 requests per step, got {rate}")
    sizes, gaps = random.Random(seed), random.Random(seed + 1)
    now, requests = 0.0, []
    for number in range(shape.requests):
        own = sizes.randint(*shape.own_prompt)
        output = sizes.randint(*shape.output)
        request: dict = {"id": f"r{number}", "arrival": int(now), "prompt_len": own, "output_len": output}
        if shape.system_prompt:
            request["prefix_group"] = "system"
        if shape.samples_every and number % shape.samples_every == 0:
            request["samples"] = 2
        requests.append(request)
        now += gaps.expovariate(1.0) / rate
    return {
        "format": FORMAT,
        "name": f"poisson-{rate:g}",
        "origin": "constructed",
        "provenance": {"kind": "constructed", "generator": GENERATOR, "seed": seed},
        "description": f"{shape.requests} requests arriving as a Poisson process at {rate:g} per step (seed {seed})",
        "prefix_groups": {"system": {"length": shape.system_prompt}} if shape.system_prompt else {},
        "requests": requests,
    }


def poisson(rate: float, seed: int, shape: ArrivalShape = ArrivalShape()) -> Workload:
    return parse_workload(poisson_json(rate, seed, shape), f"poisson:{rate:g}")
