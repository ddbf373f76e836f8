"""How fast kvfuzz's machine finds each zoo variant, and what it adds over plain random testing.

For every variant and several seeds it runs the machine (Hypothesis: swarm of enabled rules, shrinking) and, in
the same run, the random baseline of benchmarks/random_baseline.py (same operations, same checks, random programs
of the same length, no Hypothesis). It reports, per variant, the median and worst examples and seconds to the first
failure, the median shrunk program length (the baseline cannot shrink: its failing program's length), and whether
the expected invariant caught it. Writes a markdown table to stdout and everything to a JSON file.

Usage: python benchmarks/detection.py [--seeds N] [--examples N] [--steps N] [--only NAME ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Optional, Sequence

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_baseline import first_failure  # noqa: E402

from kvfuzz.runner import run  # noqa: E402
from kvfuzz.statemachines import MachineConfig  # noqa: E402
from kvfuzz.zoo import VARIANTS  # noqa: E402


def _median(values: Sequence[Optional[float]]) -> Optional[float]:
    found = [v for v in values if v is not None]
    return statistics.median(found) if len(found) == len(values) else None


def _worst(values: Sequence[Optional[float]]) -> Optional[float]:
    return None if any(v is None for v in values) else max(values)


def _fmt(value: Optional[float], digits: int = 2) -> str:
    if value is None:
        return "escaped"
    return f"{value:.{digits}f}" if isinstance(value, float) and digits else f"{value:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--examples", type=int, default=2000, help="budget per variant and seed")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--only", nargs="+", default=())
    parser.add_argument("--json", default="benchmarks/results/detection.json")
    args = parser.parse_args()

    config = MachineConfig()
    records = []
    print("| variant | caught (expected invariant) | machine: median / worst examples | machine: median / worst s "
          "| median shrunk length | random: median / worst examples | random: median / worst s "
          "| random: median program length |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for variant in VARIANTS:
        if args.only and variant.name not in args.only:
            continue
        machine = [run(variant.factory(), config, examples=args.examples, steps=args.steps, seed=seed,
                       allocator_name=f"zoo:{variant.name}") for seed in range(args.seeds)]
        baseline = [first_failure(variant.factory(), config, seed=seed, examples=args.examples, steps=args.steps)
                    for seed in range(args.seeds)]
        expected = sum(s.failed and s.invariant == str(variant.expected) for s in machine)
        m_examples = [s.first_failure_examples for s in machine]
        m_seconds = [s.first_failure_seconds for s in machine]
        lengths = [s.program_length if s.failed else None for s in machine]
        b_examples = [b.examples for b in baseline]
        b_seconds = [b.seconds for b in baseline]
        b_lengths = [b.program_length for b in baseline]
        row = (variant.name, f"{expected}/{args.seeds}",
               f"{_fmt(_median(m_examples), 0)} / {_fmt(_worst(m_examples), 0)}",
               f"{_fmt(_median(m_seconds))} / {_fmt(_worst(m_seconds))}", _fmt(_median(lengths), 0),
               f"{_fmt(_median(b_examples), 0)} / {_fmt(_worst(b_examples), 0)}",
               f"{_fmt(_median(b_seconds))} / {_fmt(_worst(b_seconds))}", _fmt(_median(b_lengths), 0))
        print("| " + " | ".join(row) + " |", flush=True)
        records.append({"variant": variant.name, "bug_class": variant.bug_class, "expected": str(variant.expected),
                        "machine": [s.to_json() for s in machine],
                        "baseline": [attrs.asdict(b) for b in baseline]})

    def overall(key: str, source: str) -> list[Optional[float]]:
        values = []
        for record in records:
            for item in record[source]:
                values.append(item.get(key))
        return values

    m_seconds = overall("first_failure_seconds", "machine")
    b_seconds = overall("seconds", "baseline")
    m_found = [v for v in m_seconds if v is not None]
    b_found = [v for v in b_seconds if v is not None]
    lengths = [item["program_length"] for r in records for item in r["machine"] if item["failed"]]
    print(f"\nmachine: {len(m_found)}/{len(m_seconds)} runs failed; seconds to first failure median "
          f"{statistics.median(m_found):.2f}, worst {max(m_found):.2f}; median shrunk length "
          f"{statistics.median(lengths):g}")
    if b_found:
        print(f"random:  {len(b_found)}/{len(b_seconds)} runs failed; seconds to first failure median "
              f"{statistics.median(b_found):.2f}, worst {max(b_found):.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(records, indent=2, default=str))


if __name__ == "__main__":
    main()
