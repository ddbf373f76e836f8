"""Findings per seeded bug: how many distinct findings (signatures) one bug becomes, and whether one bug hides another.

For every allocator with one seeded bug (the zoo's variants) and every allocator with several
(:data:`kvfuzz.zoo.combined.COMBINED`), the same random programs (``--programs`` programs of up to ``--steps`` calls,
seeded) are run, and every failing program is given two signatures side by side:

* before: the invariant and the failing operation (what a signature was before checks named causes; computed from
  the same violation, its cause dropped);
* after: :func:`kvfuzz.shrink.signature.signature_of`, the invariant and the cause its check named (the operation
  only where the cause says so).

For the one-bug allocators it prints the distinct findings per bug under each, and the ratio over all bugs found.
For each combined allocator it keeps the first program of each distinct finding (what a campaign shrinks and saves),
replays it against each of its bugs' one-bug variants, and counts a bug as shown when some kept program fails there
with the same signature; a bug that its one-bug variant shows under the same programs but none of the combined
allocator's kept findings shows is hidden.

Usage: python benchmarks/findings.py [--programs N] [--steps N] [--seed N] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Callable, Iterator, Sequence

from kvfuzz.allocator.types import PoolSpec
from kvfuzz.engine import MachineConfig
from kvfuzz.engine.violations import InvariantViolation, violation
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Target
from kvfuzz.program.random_programs import random_program
from kvfuzz.program.replay import NotApplicable, replay
from kvfuzz.registry import load_factory
from kvfuzz.shrink.signature import Signature, signature_of
from kvfuzz.threads import single_threaded_torch
from kvfuzz.zoo import VARIANTS, Variant
from kvfuzz.zoo.combined import COMBINED, Combined

Factory = Callable[[PoolSpec], object]
Signer = Callable[[str, BaseException, Sequence[Call], "int | None"], Signature]


def before(allocator: str, failure: BaseException, calls: Sequence[Call], failed_at: int | None) -> Signature:
    """The signature as it was before checks named causes: the same violation without its cause."""
    if isinstance(failure, InvariantViolation):
        failure = violation(failure.invariant, failure.operation, failure.step, failure.summary, failure.details)
    return signature_of(allocator, failure, calls, failed_at)


after: Signer = signature_of
SIGNERS: dict[str, Signer] = {"before": before, "after": after}


def failures(
    factory: Factory, programs: int, steps: int, seed: int
) -> Iterator[tuple[tuple[Call, ...], BaseException, int | None]]:
    """Every failing program among ``programs`` seeded random programs, with where it failed (replayed to find it)."""
    target = Target(factory, MachineConfig())  # type: ignore[arg-type]
    rng = random.Random(seed)
    for _ in range(programs):
        found = random_program(target, rng, rng.randint(1, steps))
        if found is None or not found.calls:
            continue
        outcome = replay(target, found.calls)
        if outcome.failure is not None:
            yield found.calls, outcome.failure, outcome.failed_at


def findings(
    spec: str, factory: Factory, programs: int, steps: int, seed: int
) -> dict[str, dict[Signature, tuple[Call, ...]]]:
    """Signer name -> each distinct signature met, with the first program that met it."""
    kept: dict[str, dict[Signature, tuple[Call, ...]]] = {name: {} for name in SIGNERS}
    for calls, failure, failed_at in failures(factory, programs, steps, seed):
        for name, sign in SIGNERS.items():
            kept[name].setdefault(sign(spec, failure, calls, failed_at), calls)
    return kept


def shows(bug: Variant, signature: Signature, calls: tuple[Call, ...], sign: Signer) -> bool:
    """Whether ``calls`` fails on ``bug``'s one-bug variant with ``signature`` (its allocator aside)."""
    spec = f"zoo:{bug.name}"
    try:
        outcome = replay(Target(bug.factory(), MachineConfig()), calls)
    except NotApplicable:
        return False
    if outcome.failure is None:
        return False
    found = sign(spec, outcome.failure, calls, outcome.failed_at)
    return found == Signature(spec, signature.failure, signature.operation, signature.frame, signature.cause)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=120, help="random programs per allocator (default 120)")
    parser.add_argument("--steps", type=int, default=40, help="the longest program, in calls (default 40)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", nargs="*", help="one-bug variants to measure (default: all)")
    args = parser.parse_args()
    started = time.process_time()
    single: dict[str, dict[str, dict[Signature, tuple[Call, ...]]]] = {}
    variants = [v for v in VARIANTS if not args.only or v.name in args.only]
    print("| one-bug variant | findings before | findings after |")
    print("|---|---|---|")
    with single_threaded_torch():
        for variant in variants:
            spec = f"zoo:{variant.name}"
            single[variant.name] = findings(spec, variant.factory(), args.programs, args.steps, args.seed)
            counts = [len(single[variant.name][name]) for name in SIGNERS]
            if counts[0]:
                print(f"| {variant.name} | {counts[0]} | {counts[1]} |", flush=True)
        found = [name for name in single if single[name]["before"]]
        totals = {name: sum(len(single[bug][name]) for bug in found) for name in SIGNERS}
        print(
            f"\n{len(found)} of {len(variants)} one-bug variants failed; distinct findings per seeded bug: "
            + ", ".join(
                f"{name} {totals[name]}/{len(found)} = {totals[name] / max(1, len(found)):.2f}" for name in SIGNERS
            )
        )
        print("\n| combined allocator | its bugs | findings before | shown before | findings after | shown after |")
        print("|---|---|---|---|---|---|")
        hidden = {name: 0 for name in SIGNERS}
        for combined in COMBINED:
            row = _combined_row(combined, single, args, hidden)
            print(row, flush=True)
    print(
        "\nbugs hidden on the combined allocators (shown by their one-bug variant, by no finding of the combined): "
        + ", ".join(f"{name} {hidden[name]}" for name in SIGNERS)
    )
    print(f"{time.process_time() - started:.0f} CPU-seconds")


def _combined_row(
    combined: Combined,
    single: dict[str, dict[str, dict[Signature, tuple[Call, ...]]]],
    args: argparse.Namespace,
    hidden: dict[str, int],
) -> str:
    kept = findings(combined.spec, load_factory(combined.spec), args.programs, args.steps, args.seed)
    cells = [combined.factory, ", ".join(bug.name for bug in combined.bugs)]
    for name, sign in SIGNERS.items():
        shown = [
            bug.name
            for bug in combined.bugs
            if any(shows(bug, signature, calls, sign) for signature, calls in kept[name].items())
        ]
        for bug in combined.bugs:
            if bug.name not in shown and single.get(bug.name, {}).get(name):
                hidden[name] += 1
        cells += [str(len(kept[name])), ", ".join(shown) or "none"]
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
