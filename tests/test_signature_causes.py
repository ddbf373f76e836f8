"""One finding per bug, both ways: a signature is the invariant and the cause its check names, so two bugs breaking
one invariant in one operation are two findings, one bug met through several operations is one, and a campaign's
known trace makes known only the failure it recorded."""

from __future__ import annotations

import ast
import random
from pathlib import Path
from typing import Callable

import attrs
import pytest

import kvfuzz.engine
from kvfuzz.allocator import paged_allocator
from kvfuzz.campaign.allocators import AllocatorTraces
from kvfuzz.campaign.known import known_findings
from kvfuzz.engine import Engine, Invariant, MachineConfig
from kvfuzz.engine.checks.accounting import OVER_COUNT, UNDER_COUNT
from kvfuzz.engine.violations import REFINED, InvariantViolation, violation
from kvfuzz.program.execution import Target
from kvfuzz.program.random_programs import random_program
from kvfuzz.program.replay import replay
from kvfuzz.registry import load_factory
from kvfuzz.saved.trace import Trace, failure_record, save
from kvfuzz.shrink.fixpoint import shrink
from kvfuzz.shrink.signature import signature_of


def _failures(spec: str, programs: int, seed: int = 1) -> list:
    """(calls, violation, failed_at) of every failing program among ``programs`` seeded random programs."""
    target = Target(load_factory(spec), MachineConfig())
    rng = random.Random(seed)
    found = []
    for _ in range(programs):
        failed = random_program(target, rng, rng.randint(1, 40))
        if failed is None:
            continue
        outcome = replay(target, failed.calls)
        assert isinstance(outcome.failure, InvariantViolation)
        found.append((failed.calls, outcome.failure, outcome.failed_at))
    return found


def _without_cause(failure: InvariantViolation) -> InvariantViolation:
    return violation(failure.invariant, failure.operation, failure.step, failure.summary, failure.details)


def test_two_bugs_breaking_one_invariant_in_one_operation_are_two_findings() -> None:
    # Blocks matchable before they are written, and a cache key without the namespace: both break cache soundness
    # in admit, which invariant and operation alone merged into one finding.
    spec = "kvfuzz.zoo.combined:unwritten_and_namespace"
    in_admit = [
        (calls, failure, at)
        for calls, failure, at in _failures(spec, 150)
        if signature_of(spec, _without_cause(failure), calls, at).operation == "admit"
    ]
    causes = {signature_of(spec, failure, calls, at).cause for calls, failure, at in in_admit}
    assert {
        "a cache hit on K/V no completed step has written",
        "a cache hit on a block that holds, or is about to hold, another prefix's K/V",
    } <= causes
    assert len({signature_of(spec, _without_cause(f), c, a) for c, f, a in in_admit}) == 1


def test_one_bug_met_through_several_operations_is_one_finding() -> None:
    # A free that skips shared blocks leaves refcounts too high, met by whichever operation next touches the block.
    spec = "zoo:FreeForgetsSharedRefcount"
    found = _failures(spec, 60)
    operations = {signature_of(spec, _without_cause(f), calls, at).operation for calls, f, at in found}
    assert len(operations) >= 2
    signatures = {signature_of(spec, failure, calls, at) for calls, failure, at in found}
    assert len(signatures) == 1
    (signature,) = signatures
    assert signature.operation is None and signature.cause is not None and signature.cause.startswith("a refcount")
    assert "a refcount above the table entries" in str(signature)  # the report says the cause in words


def test_a_known_trace_makes_known_its_bug_whatever_operation_meets_it(tmp_path: Path) -> None:
    spec = "zoo:FreeForgetsSharedRefcount"
    found = _failures(spec, 60)
    calls, failure, _ = found[0]
    save(Trace(spec, MachineConfig(), calls, failure_record(failure), known_bug="unfixed"), tmp_path)
    known = known_findings([tmp_path], AllocatorTraces([spec], 30)).where()
    assert known
    for calls, other, at in found:  # met in several operations: every one is the known bug
        assert signature_of(spec, other, calls, at).key() in known


def test_a_known_trace_that_now_fails_for_another_cause_hides_nothing(tmp_path: Path) -> None:
    # The trace recorded an under-count; its program now breaks the same invariant for another cause (a
    # regression on the known bug's path): that new failure must stay new.
    spec = "zoo:FreeForgetsSharedRefcount"
    calls, failure, at = _failures(spec, 60)[0]
    recorded = "a refcount below the table entries naming the block: a reference released too often or never taken"
    assert failure.cause.words != recorded
    trace = Trace(spec, MachineConfig(), calls, {**failure_record(failure), "cause": recorded})
    save(trace, tmp_path)
    assert known_findings([tmp_path], AllocatorTraces([spec], 30)).where() == {}
    # The same trace recording the cause it reproduces makes it known.
    save(attrs.evolve(trace, failure=failure_record(failure)), tmp_path / "same")
    assert known_findings([tmp_path / "same"], AllocatorTraces([spec], 30)).where()


def test_two_bugs_with_one_cause_on_different_release_paths_are_two_findings() -> None:
    # A preemption that releases a block twice and a grow that maps a block twice on one reference both leave a
    # refcount below the table entries: the preemption's is told by its release path (a whole-table release), the
    # grow's by the table it made (one block listed twice), where over- vs under-count alone merged them.
    spec = "kvfuzz.zoo.combined:under_count_two_paths"
    signatures = {signature_of(spec, failure, calls, at) for calls, failure, at in _failures(spec, 150)}
    assert {str(s.cause) for s in signatures} == {
        f"{UNDER_COUNT.words}{REFINED}last touched by a release of a sequence's whole device table "
        "(free, preempt or swap-out)",
        "a block repeated in one table",
    }
    assert all(s.operation is None for s in signatures)


def test_a_trace_recording_the_coarser_cause_still_reproduces_the_refined_one(tmp_path: Path) -> None:
    # Traces saved before a cause was refined (the refcount's release path) still reproduce their failure and
    # make it known, under the refined signature.
    spec = "zoo:FreeForgetsSharedRefcount"
    calls, failure, at = _failures(spec, 60)[0]
    assert failure.cause.words.startswith(OVER_COUNT.words + REFINED)
    save(Trace(spec, MachineConfig(), calls, {**failure_record(failure), "cause": OVER_COUNT.words}), tmp_path)
    assert set(known_findings([tmp_path], AllocatorTraces([spec], 30)).where()) == {
        signature_of(spec, failure, calls, at).key()
    }


def _fail_calls_without_cause() -> list[str]:
    """Every ``fail(...)`` call of kvfuzz's checks that passes no cause (fewer than four arguments, none starred,
    no ``cause=``): a violation it raises would be keyed by its operation."""
    engine = Path(kvfuzz.engine.__file__).parent
    found = []
    for path in sorted(engine.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fail"):
                continue
            starred = any(isinstance(arg, ast.Starred) for arg in node.args)
            if len(node.args) < 4 and not starred and not any(k.arg == "cause" for k in node.keywords):
                found.append(f"{path.relative_to(engine)}:{node.lineno}")
    return found


def test_every_check_names_a_cause() -> None:
    # Quiescence, refusals and misuse, results, eviction order, complete caching, groups and the checks of
    # engine/features named none, and stayed keyed by the operation that met them.
    assert _fail_calls_without_cause() == []


def _attention_mismatch(tamper: Callable[[Engine, int, int], None]) -> InvariantViolation:
    """The attention check's violation after ``tamper(engine, slot of s0's position 1, slot of s1's position 1)``
    changed the pool behind the content check's back (as a write it cannot see would)."""
    config = MachineConfig(block_size=4, num_blocks=12)
    h = Engine(paged_allocator(config.pool_spec()), config)
    assert h.admit("s0", (), (1, 2, 3, 4, 5, 6)) and h.admit("s1", (), (7, 8, 9))
    h.step()
    slots = [h.expected.layout(seq).slot_of(h.expected.seqs[seq].table, 1) for seq in ("s0", "s1")]
    tamper(h, *slots)
    with pytest.raises(InvariantViolation) as caught:
        h.checks.attention.check()
    assert caught.value.invariant is Invariant.ATTENTION
    return caught.value


def test_an_attention_mismatch_names_the_write_that_left_the_wrong_kv() -> None:
    # Attention had one cause, whatever it read; it now names the kind of write the first wrong position holds, as
    # the content check does: another sequence's K/V, a stale copy, never-written K/V. (Where every position read
    # holds its own K/V by the record, a kernel reading them wrong, it names UNEXPLAINED_ATTENTION, as before.)
    def other_sequence(h: Engine, mine: int, theirs: int) -> None:
        h.pools.keys[mine], h.pools.values[mine] = h.pools.keys[theirs], h.pools.values[theirs]
        h.pools.shadow[mine] = h.pools.shadow[theirs]

    def never_written(h: Engine, mine: int, theirs: int) -> None:
        h.pools.keys[mine], h.pools.values[mine] = 0, 0
        del h.pools.shadow[mine]

    def stale_copy(h: Engine, mine: int, theirs: int) -> None:
        other_sequence(h, mine, theirs)
        h.pools.shadow[mine] = attrs.evolve(h.pools.shadow[theirs], via="copied from block 3")

    assert (
        _attention_mismatch(other_sequence).cause.words == "a write for another prefix into a block this sequence maps"
    )
    assert _attention_mismatch(stale_copy).cause.words == (
        "a copy-on-write copy brought another prefix's K/V (stale content after a copy)"
    )
    assert _attention_mismatch(never_written).cause.words == "a position whose slot no write reached"


@pytest.mark.parametrize(
    ("name", "invariant"),
    [
        ("LeakyRefusal", Invariant.ATOMIC_REFUSAL),
        ("LookaheadKeepsCachedBlock", Invariant.CACHE_SOUNDNESS),
        ("BlockInBothGroups", Invariant.REFCOUNTS),
        ("OpaqueLeakOnCancel", Invariant.NO_FALSE_REFUSAL),
    ],
)
def test_bugs_that_checks_without_a_cause_split_by_operation_are_one_finding(name: str, invariant: Invariant) -> None:
    # Atomic refusal, a look-ahead check, a KV-cache-group check and a false refusal named no cause: each of these
    # bugs was one finding per operation that met the invariant.
    spec = f"zoo:{name}"
    found = [(calls, f, at) for calls, f, at in _failures(spec, 60) if f.invariant is invariant]
    assert len({signature_of(spec, _without_cause(f), calls, at) for calls, f, at in found}) >= 2
    assert len({signature_of(spec, failure, calls, at) for calls, failure, at in found}) == 1


def test_shrunk_programs_of_one_bug_met_through_several_operations_end_in_one_cause() -> None:
    # A campaign keys its findings by signature and shrinks each keeping it: FreeForgetsSharedRefcount's programs,
    # failing in free, preempt and swap_out, shrink to programs that end in the same cause, one finding.
    spec = "zoo:FreeForgetsSharedRefcount"
    factory = load_factory(spec)
    by_operation = {}
    for calls, failure, at in _failures(spec, 60):
        by_operation.setdefault(signature_of(spec, _without_cause(failure), calls, at).operation, (calls, failure, at))
    assert len(by_operation) >= 2
    shrunk = set()
    for calls, failure, at in by_operation.values():
        signature = signature_of(spec, failure, calls, at)
        result = shrink(factory, MachineConfig(), calls, failure, signature, seconds=20)
        assert len(result.calls) <= len(calls)
        outcome = replay(Target(factory, result.config), result.calls)
        assert outcome.failure is not None
        shrunk.add(signature_of(spec, outcome.failure, result.calls, outcome.failed_at))
    assert len(shrunk) == 1
