"""Output unchanged by paging, end to end: a tiny seeded transformer generating greedily with its K/V in kvfuzz's
paged pools gives the same tokens and bit-identical logits as with a contiguous cache, while sharing (prefix-cache
hits, forks), copy-on-write, preemption with recomputation and reclamation all happen; broken allocators from the
zoo make the output differ."""

from __future__ import annotations

import pytest
import torch

from kvfuzz.allocator.types import PoolSpec
from kvfuzz.model.paged_generation import (
    GenerationRequest,
    PagedGeneration,
    differences,
    generate_contiguous,
)
from kvfuzz.model.tiny_lm import TinyConfig, TinyLM
from kvfuzz.registry import load_factory
from kvfuzz.workload.format import derived_tokens

CONFIG = TinyConfig(vocab=64, layers=2, heads=2, head_dim=8, mlp=32, seed=0)
SYSTEM = tuple(token % CONFIG.vocab for token in derived_tokens("system", 10))


def requests() -> list[GenerationRequest]:
    """Six requests sharing a 10-token system prompt (prefix-cache hits), two with two samples each (forks from a
    partly filled tail block: copy-on-write), arriving two per round into a pool too small for all (preemption)."""
    return [
        GenerationRequest(
            f"r{n}",
            SYSTEM + tuple(token % CONFIG.vocab for token in derived_tokens(f"r{n}", 3 + n % 4)),
            10 + 2 * n,
            samples=2 if n % 3 == 0 else 1,
            arrival=n // 2,
        )
        for n in range(6)
    ]


@pytest.fixture(scope="module")
def model() -> TinyLM:
    torch.set_num_threads(1)
    return TinyLM(CONFIG)


@pytest.fixture(scope="module")
def reference(model: TinyLM) -> dict:
    return generate_contiguous(model, requests())


def paged_run(model: TinyLM, allocator: str) -> PagedGeneration:
    generation = PagedGeneration(model, load_factory(allocator)(PoolSpec(block_size=4, num_blocks=20)))
    generation.run(requests())
    return generation


@pytest.mark.parametrize(
    "allocator", ["kvfuzz.allocator.paged:paged_allocator", "kvfuzz.allocator.paged:synchronous_allocator"]
)
def test_paged_generation_matches_the_contiguous_cache_bit_for_bit(
    model: TinyLM, reference: dict, allocator: str
) -> None:
    generation = paged_run(model, allocator)
    assert differences(generation.outputs, reference) == []
    assert set(generation.outputs) == set(reference)
    events = generation.events
    # everything the check is meant to cover happened
    assert events["cache-hit tokens"] > 0, "no prefix sharing"
    assert events["forks"] == 2, "no forks"
    assert events["copy-on-write copies"] > 0, "no copy-on-write"
    assert events["preemptions"] > 0 and events["readmissions"] == events["preemptions"], "no preemption"
    assert events["reused blocks"] > 0, "no reclamation"


def test_the_reference_is_not_degenerate(model: TinyLM, reference: dict) -> None:
    """Samples diverge, and another seed gives other tokens: a check of equal outputs is not vacuous."""
    assert reference["r0"].tokens != reference["r0/1"].tokens
    assert len({output.tokens for output in reference.values()}) > 4
    other = generate_contiguous(TinyLM(TinyConfig(seed=1)), requests()[:1])
    assert other["r0"].tokens != reference["r0"].tokens


@pytest.mark.parametrize("variant", ["NoCopyOnWrite", "CopiesWrongBlock"])
def test_a_broken_allocator_changes_the_output(model: TinyLM, reference: dict, variant: str) -> None:
    found = differences(paged_run(model, f"zoo:{variant}").outputs, reference)
    assert found, f"{variant} left the output unchanged"
    assert "logits of generated token" in found[0]
