"""Running the machine against every zoo variant, and the table that reports it."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import attrs

from kvfuzz.engine.config import MachineConfig
from kvfuzz.runner import RunSummary, run
from kvfuzz.zoo import VARIANTS, Variant

COLUMNS = (
    "variant",
    "bug class",
    "caught",
    "invariant",
    "examples to 1st failure",
    "seconds to 1st failure",
    "shrunk length",
)


@attrs.frozen
class ZooResult:
    """One variant's run: caught or not, by which invariant, how fast, and how small the shrunk program is."""

    variant: Variant
    summary: RunSummary

    @property
    def caught_as_expected(self) -> bool:
        return self.summary.failed and self.summary.violated is self.variant.expected

    def row(self) -> tuple[str, ...]:
        s = self.summary
        if not s.failed:
            caught = "ESCAPED"
        else:
            caught = "yes" if self.caught_as_expected else f"yes, but expected {self.variant.expected}"
        return (
            self.variant.name,
            self.variant.bug_class,
            caught,
            s.invariant or "-",
            "-" if s.first_failure_examples is None else str(s.first_failure_examples),
            "-" if s.first_failure_seconds is None else f"{s.first_failure_seconds:.2f}",
            "-" if not s.program else str(s.program_length) if s.shrunk else f"{s.program_length} (unshrunk)",
        )

    def to_json(self) -> dict:
        return {
            "variant": self.variant.name,
            "bug_class": self.variant.bug_class,
            "expected": str(self.variant.expected),
            "caught_as_expected": self.caught_as_expected,
            **self.summary.to_json(),
        }


def run_zoo(
    config: MachineConfig = MachineConfig(),
    *,
    examples: int,
    steps: int = 50,
    seed: Optional[int] = None,
    shrink: bool = True,
    names: Iterable[str] = (),
    deep: bool = False,
    on_result: Optional[Callable[[ZooResult], None]] = None,
) -> list[ZooResult]:
    """Run the machine for ``examples`` examples against each variant (those named, or else every variant a default
    run is expected to catch, and the deep ones too when ``deep`` is set); report each result as it comes."""
    wanted = set(names)
    unknown = wanted - {variant.name for variant in VARIANTS}
    if unknown:
        raise KeyError(f"no zoo variant named {', '.join(sorted(unknown))}")
    results = []
    for variant in VARIANTS:
        if wanted and variant.name not in wanted or not wanted and variant.deep and not deep:
            continue
        summary = run(
            variant.factory(),
            config,
            examples=examples,
            steps=steps,
            seed=seed,
            shrink=shrink,
            allocator_name=f"zoo:{variant.name}",
        )
        result = ZooResult(variant, summary)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def markdown_row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown_header() -> str:
    return markdown_row(COLUMNS) + "\n" + markdown_row("---" for _ in COLUMNS)
