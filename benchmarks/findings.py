"""Findings per seeded bug: how many distinct findings (signatures) one bug becomes, and whether one bug hides another.

For every allocator with one seeded bug (the zoo's variants), every allocator with one bug written independently of
the signature code (:data:`benchmarks.independent.BUGS`, by someone given only bug reports and the contract) and every
allocator with several (:data:`kvfuzz.zoo.combined.COMBINED`), the same random programs (``--programs`` programs of up
to ``--steps`` calls, seeded) are run, each failing program is replayed (which audits the whole observable state after
every call), and given three signatures side by side:

* operation: the invariant and the failing operation (what a signature was before checks named causes; computed from
  the same violation, its cause dropped);
* cause: the invariant and the cause the failing check named (the operation only where the cause says so), whatever
  the audit found before the failure (what a signature was before it was keyed by the first divergence);
* divergence: :func:`kvfuzz.shrink.signature.signature_of` with the replay's divergence: the invariant and cause of
  the first call after which the audit found the allocator's state departed from the model, else the cause's.

For each set of one-bug allocators it prints the distinct findings per bug under each, and the ratio over all bugs
found; one-bug allocators no program fails are listed.
For each combined allocator it keeps the first program of each distinct finding (what a campaign shrinks and saves),
replays it against each of its bugs' one-bug variants, and counts a bug as shown when some kept program fails there
with the same signature; a bug that its one-bug variant shows under the same programs but none of the combined
allocator's kept findings shows is hidden.

Usage: python benchmarks/findings.py [--programs N] [--steps N] [--seed N] [--only NAME ...] [--sets zoo independent]
"""

from __future__ import annotations

import argparse
import importlib
import random
import time
from typing import Any, Callable, Iterator, Sequence

from kvfuzz.allocator.types import PoolSpec
from kvfuzz.engine import MachineConfig
from kvfuzz.engine.violations import InvariantViolation, violation
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Target
from kvfuzz.program.random_programs import random_program
from kvfuzz.program.replay import Divergence, NotApplicable, replay
from kvfuzz.registry import load_factory
from kvfuzz.shrink.signature import Signature, signature_of
from kvfuzz.threads import single_threaded_torch
from kvfuzz.zoo import VARIANTS, Variant
from kvfuzz.zoo.combined import COMBINED, Combined

Factory = Callable[[PoolSpec], object]
Signer = Callable[[str, BaseException, Sequence[Call], "int | None", "Divergence | None"], Signature]


def by_operation(
    allocator: str, failure: BaseException, calls: Sequence[Call], failed_at: int | None, diverged: Divergence | None
) -> Signature:
    """The signature as it was before checks named causes: the same violation without its cause."""
    if isinstance(failure, InvariantViolation):
        failure = violation(failure.invariant, failure.operation, failure.step, failure.summary, failure.details)
    return signature_of(allocator, failure, calls, failed_at)


def by_cause(
    allocator: str, failure: BaseException, calls: Sequence[Call], failed_at: int | None, diverged: Divergence | None
) -> Signature:
    """The signature as it was before the first divergence keyed it: the failing check's cause."""
    return signature_of(allocator, failure, calls, failed_at)


SIGNERS: dict[str, Signer] = {"operation": by_operation, "cause": by_cause, "divergence": signature_of}
SETS = ("zoo", "independent")
INDEPENDENT = "independent"
"""The package beside this script holding the independent one-bug allocators (``BUGS``: records with a ``name`` and a
``factory`` from a :class:`~kvfuzz.allocator.types.PoolSpec`)."""


def independent_bugs() -> Sequence[Any] | None:
    """``BUGS`` of the independent set, or None where this tree has none."""
    try:
        module = importlib.import_module(INDEPENDENT)
    except ModuleNotFoundError as error:
        if error.name != INDEPENDENT:
            raise
        return None
    return tuple(module.BUGS)


def failures(
    factory: Factory, programs: int, steps: int, seed: int
) -> Iterator[tuple[tuple[Call, ...], BaseException, int | None, Divergence | None]]:
    """Every failing program among ``programs`` seeded random programs, with where it failed and where it first
    diverged (replayed to find both)."""
    target = Target(factory, MachineConfig())  # type: ignore[arg-type]
    rng = random.Random(seed)
    for _ in range(programs):
        found = random_program(target, rng, rng.randint(1, steps))
        if found is None or not found.calls:
            continue
        outcome = replay(target, found.calls)
        if outcome.failure is not None:
            yield found.calls, outcome.failure, outcome.failed_at, outcome.diverged


def findings(
    spec: str, factory: Factory, programs: int, steps: int, seed: int
) -> dict[str, dict[Signature, tuple[Call, ...]]]:
    """Signer name -> each distinct signature met, with the first program that met it."""
    kept: dict[str, dict[Signature, tuple[Call, ...]]] = {name: {} for name in SIGNERS}
    for calls, failure, failed_at, diverged in failures(factory, programs, steps, seed):
        for name, sign in SIGNERS.items():
            kept[name].setdefault(sign(spec, failure, calls, failed_at, diverged), calls)
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
    found = sign(spec, outcome.failure, calls, outcome.failed_at, outcome.diverged)
    return found == Signature(spec, signature.failure, signature.operation, signature.frame, signature.cause)


def one_bug_set(
    title: str, bugs: Sequence[tuple[str, str, Factory]], args: argparse.Namespace
) -> dict[str, dict[str, dict[Signature, tuple[Call, ...]]]]:
    """The findings of each one-bug allocator of a set (name, spec, factory) under every signer, printed as a table
    with the ratio over the bugs found; the bugs no program finds are listed."""
    measured: dict[str, dict[str, dict[Signature, tuple[Call, ...]]]] = {}
    print(f"\n| {title} | " + " | ".join(f"findings by {name}" for name in SIGNERS) + " |")
    print("|---|" + "---|" * len(SIGNERS))
    for name, spec, factory in bugs:
        measured[name] = findings(spec, factory, args.programs, args.steps, args.seed)
        counts = [len(measured[name][signer]) for signer in SIGNERS]
        if counts[0]:
            print(f"| {name} | " + " | ".join(str(count) for count in counts) + " |", flush=True)
    found = [name for name in measured if measured[name]["operation"]]
    totals = {signer: sum(len(measured[bug][signer]) for bug in found) for signer in SIGNERS}
    print(
        f"\n{title}: {len(found)} of {len(bugs)} failed; distinct findings per bug: "
        + ", ".join(
            f"{signer} {totals[signer]}/{len(found)} = {totals[signer] / max(1, len(found)):.2f}" for signer in SIGNERS
        )
    )
    never = [name for name in measured if name not in found]
    print(f"{title} no program failed: {', '.join(never) or 'none'}")
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=120, help="random programs per allocator (default 120)")
    parser.add_argument("--steps", type=int, default=40, help="the longest program, in calls (default 40)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", nargs="*", help="one-bug allocators to measure, of either set (default: all)")
    parser.add_argument(
        "--sets", nargs="*", choices=SETS, help="which sets to measure (default: every one this tree has)"
    )
    args = parser.parse_args()
    independent = independent_bugs()
    if args.sets is None:
        args.sets = [name for name in SETS if name != "independent" or independent is not None]
    if "independent" in args.sets and independent is None:
        parser.error("no benchmarks/independent in this tree to measure: use --sets zoo")
    started = time.process_time()
    hidden = {name: 0 for name in SIGNERS}
    with single_threaded_torch():
        if "zoo" in args.sets:
            variants = [v for v in VARIANTS if not args.only or v.name in args.only]
            single = one_bug_set(
                "zoo one-bug variant", [(v.name, f"zoo:{v.name}", v.factory()) for v in variants], args
            )
            print(
                "\n| combined allocator | its bugs | "
                + " | ".join(f"findings by {name} | shown by {name}" for name in SIGNERS)
                + " |"
            )
            print("|---|---|" + "---|---|" * len(SIGNERS))
            for combined in COMBINED:
                print(_combined_row(combined, single, args, hidden), flush=True)
            print(
                "\nbugs hidden on the combined allocators (shown by their one-bug variant, by no finding of the "
                "combined): " + ", ".join(f"{name} {hidden[name]}" for name in SIGNERS)
            )
        if "independent" in args.sets:
            bugs = [bug for bug in independent or () if not args.only or bug.name in args.only]
            one_bug_set("independent one-bug allocator", [(bug.name, bug.name, bug.factory) for bug in bugs], args)
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
