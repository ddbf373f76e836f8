"""Findings keyed by where the allocator first diverged from the model (kvfuzz/engine/checks/divergence.py, the
replay's audit, and kvfuzz/shrink/signature.py): one bug whose damage later calls notice in different ways is one
finding."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Sequence

import attrs

from kvfuzz.allocator import PagedAllocator, PoolSpec
from kvfuzz.allocator.types import GrowResult, SeqId, Tokens
from kvfuzz.campaign.allocators import AllocatorTraces
from kvfuzz.campaign.known import known_findings
from kvfuzz.engine.arguments import system_prompts
from kvfuzz.engine.checks.divergence import TABLE_CHANGED
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Execution, Target
from kvfuzz.program.random_programs import random_program
from kvfuzz.program.replay import replay
from kvfuzz.registry import load_factory
from kvfuzz.saved.trace import Trace, failure_record, save
from kvfuzz.shrink.signature import Signature, signature_of


class _ReleasesSharedTailOnGrow(PagedAllocator):
    """A grow that opens a new block releases its reference to the block before, once, when that block is shared
    (as if it had been copied on write): the block stays in the table with a refcount one too low, and nothing the
    grow was expected to touch changed, so the damage is noticed only by a later call."""

    def grow(self, seq: SeqId, tokens: Tokens) -> GrowResult:
        before = list(self._seqs[seq].table) if seq in self._seqs else []
        result = super().grow(seq, tokens)
        table = self._seqs[seq].table
        if before and len(table) > len(before) and self._pool.refcount(before[-1]) > 1:
            self._pool.release(before[-1])
        return result


def _factory(spec: PoolSpec) -> PagedAllocator:
    return _ReleasesSharedTailOnGrow(spec.block_size, spec.num_blocks, spec.num_host_blocks)


def _admit(seq: str) -> Call:
    """An admission of one full block (block size 4)."""
    return Call("admit", {"seq": seq, "namespace": (), "system": system_prompts(4)[1], "suffix": [0]})


# s0's full block 0 shared with its fork s1, then s0's grow into a new block releases block 0 once too often.
_DAMAGE = [
    _admit("s0"),
    Call("step", {}),
    Call("fork", {"parent": "s0", "child": "s1"}),
    Call("grow", {"seq": "s0", "tokens": [1]}),
]
# Three ways later calls notice it: a free of the fork (the block's holders change), another fork, and the teardown.
_NOTICED = {
    "free": [*_DAMAGE, Call("free", {"seq": "s1"})],
    "fork": [*_DAMAGE, Call("step", {}), Call("fork", {"parent": "s0", "child": "s2"})],
    "preempt": [*_DAMAGE, Call("preempt", {"seq": "s1"})],
}


def _signatures(calls: Sequence[Call]) -> tuple[Signature, Signature]:
    """The program's signature keyed by its failing check's cause, and keyed by its first divergence."""
    outcome = replay(Target(_factory), calls)
    assert outcome.failure is not None
    return (
        signature_of("x", outcome.failure, calls, outcome.failed_at),
        signature_of("x", outcome.failure, calls, outcome.failed_at, outcome.diverged),
    )


def test_the_audit_names_the_call_that_made_the_wrong_change() -> None:
    outcome = replay(Target(_factory), _NOTICED["fork"])
    assert outcome.diverged is not None
    assert outcome.diverged.at == 3  # the grow, not the fork that noticed it
    assert outcome.diverged.violation.invariant is Invariant.REFCOUNTS
    assert outcome.diverged.violation.operation.startswith("grow('s0'")
    assert outcome.failed_at == 5


def test_one_bug_noticed_by_different_calls_is_one_finding() -> None:
    by_cause = {name: _signatures(calls)[0] for name, calls in _NOTICED.items()}
    by_divergence = {name: _signatures(calls)[1] for name, calls in _NOTICED.items()}
    assert len(set(by_cause.values())) > 1  # the cause alone names the path that noticed it: several findings
    assert len(set(by_divergence.values())) == 1
    (one,) = set(by_divergence.values())
    assert one.failure == str(Invariant.REFCOUNTS)
    assert one.cause is not None and one.cause.endswith("last touched by " + _GROW_PATH)


_GROW_PATH = "a grow that changed the table (a new block, a copy-on-write, a block out of the window)"


def test_a_known_trace_makes_known_its_bug_however_its_damage_is_noticed(tmp_path: Path) -> None:
    spec = f"{__name__}:_factory"
    calls = _NOTICED["free"]
    outcome = replay(Target(_factory), calls)
    assert isinstance(outcome.failure, InvariantViolation)
    save(Trace(spec, MachineConfig(), calls, failure_record(outcome.failure), known_bug="unfixed"), tmp_path)
    known = known_findings([tmp_path], AllocatorTraces([spec], 30)).where()
    for other in _NOTICED.values():  # the same bug, noticed by a fork and by a preemption: known
        again = replay(Target(_factory), other)
        assert again.failure is not None
        assert signature_of(spec, again.failure, other, again.failed_at, again.diverged).key() in known


def test_the_audit_finds_no_divergence_in_correct_allocators() -> None:
    # A divergence keys a finding: one found where the allocator is right would split or merge findings.
    for spec in ("kvfuzz", "kvfuzz-synchronous", "kvfuzz-sliding-window", "kvfuzz-hybrid"):
        target = Target(load_factory(spec), MachineConfig(num_host_blocks=4))
        rng = random.Random(spec)
        for _ in range(15):
            calls = _passing_program(target, rng)
            outcome = replay(target, calls)
            assert outcome.failure is None and outcome.diverged is None, (spec, calls)


@attrs.frozen
class _Recording(Target):
    """A target that keeps every execution it starts, so that a passing random program's calls can be read back."""

    started: list[Execution] = attrs.field(factory=list, eq=False)

    def start(self) -> Execution:
        execution = super().start()
        self.started.append(execution)
        return execution


def _passing_program(target: Target, rng: random.Random) -> tuple[Call, ...]:
    """The calls of one random program run against ``target``, which must pass."""
    recording = _Recording(target.factory, target.config)
    found = random_program(recording, rng, rng.randint(5, 60))
    assert found is None, found.failure
    return tuple(recording.started[0].calls)


def test_two_bugs_diverging_on_different_release_paths_stay_two_findings() -> None:
    # A preemption that releases a block twice and a grow that maps a block twice on one reference: keyed by where
    # each diverged, neither hides the other.
    spec = "kvfuzz.zoo.combined:under_count_two_paths"
    target = Target(load_factory(spec), MachineConfig())
    rng = random.Random(1)
    signatures = set()
    for _ in range(150):
        failed = random_program(target, rng, rng.randint(1, 40))
        if failed is None:
            continue
        outcome = replay(target, failed.calls)
        assert outcome.failure is not None
        signatures.add(signature_of(spec, outcome.failure, failed.calls, outcome.failed_at, outcome.diverged))
    causes = {str(s.cause) for s in signatures if s.failure == str(Invariant.REFCOUNTS)}
    assert {
        "a refcount below the table entries naming the block: a reference released too often or never taken; "
        "last touched by a release of a sequence's whole device table (free, preempt or swap-out)",
        "a block repeated in one table",  # the grow's bug, seen in its own call by the table's shape
    } == causes


class _ForkAliasesTable(PagedAllocator):
    """A fork whose child shares the parent's table list instead of copying it: the child's next block lands in the
    parent's table too, a change no call on the parent made."""

    def fork(self, parent: SeqId, child: SeqId) -> None:
        super().fork(parent, child)
        self._seqs[child].table = self._seqs[parent].table


def _aliasing(spec: PoolSpec) -> PagedAllocator:
    return _ForkAliasesTable(spec.block_size, spec.num_blocks, spec.num_host_blocks)


_ALIASED = [
    _admit("s0"),
    Call("step", {}),
    Call("fork", {"parent": "s0", "child": "s1"}),
    Call("grow", {"seq": "s1", "tokens": [1]}),
]


def test_a_table_another_call_altered_is_one_finding_however_it_is_read() -> None:
    noticed = {
        "grow": [*_ALIASED, Call("step", {}), Call("grow", {"seq": "s0", "tokens": [2]})],
        "free": [*_ALIASED, Call("free", {"seq": "s0"})],
        "teardown": _ALIASED,
    }
    by_cause, by_divergence = set(), set()
    for calls in noticed.values():
        outcome = replay(Target(_aliasing), calls)
        assert outcome.failure is not None and outcome.diverged is not None
        assert outcome.diverged.at == 3  # the child's grow
        by_cause.add(signature_of("x", outcome.failure, calls, outcome.failed_at))
        by_divergence.add(signature_of("x", outcome.failure, calls, outcome.failed_at, outcome.diverged))
    assert len(by_cause) > 1
    assert {signature.cause for signature in by_divergence} == {TABLE_CHANGED.words}


def test_a_withdrawn_rewrite_of_a_block_s_own_kv_is_no_divergence() -> None:
    # s1's second block is full and cached once its step completes; a rollback into it and a grow schedule a rewrite
    # of the same tokens in place (NoCopyOnWrite does not copy the cached block first), which the preemption
    # withdraws: the block keeps the K/V its cache entry names, so its staying cached is no divergence.
    calls = [
        Call("step", {}),
        Call("admit", {"seq": "s1", "namespace": ("a", "bc"), "system": system_prompts(4)[3], "suffix": [1, 3, 0]}),
        Call("step", {}),
        Call("step", {}),
        Call("rollback", {"seq": "s1", "num_tokens": 4}),
        Call("grow", {"seq": "s1", "tokens": [3, 0]}),
        Call("preempt", {"seq": "s1"}),
        Call("step", {}),
    ]
    outcome = replay(Target(load_factory("zoo:NoCopyOnWrite"), MachineConfig()), calls)
    assert outcome.failure is None
    assert outcome.diverged is None


def test_a_call_of_several_parts_is_audited_between_them() -> None:
    # A decode grows every sequence, then steps: the wrong release is s0's grow's, not the step's that follows it in
    # the same call.
    calls = [*_DAMAGE[:3], Call("decode", {"token": 0})]
    outcome = replay(Target(_factory), calls)
    assert outcome.diverged is not None and outcome.diverged.at == 3
    assert outcome.diverged.violation.operation.startswith("grow('s0'")
    assert str(outcome.diverged.violation.cause).endswith("last touched by " + _GROW_PATH)


def test_a_cache_entry_that_outlives_its_block_s_release_is_one_finding_however_its_damage_shows() -> None:
    """Issue 45, item 10, on a bug written apart from the checks (benchmarks/independent's ReleaseIgnoresCache: a
    freed block goes to the free list with its cache entry kept). Before: four findings, by what the stale hit met
    (a block repeated in a table, a held block listed free, an eviction, another prefix's K/V); now a hit on a block
    listed free, or on K/V it held when listed free that no write has replaced, is checked before those
    consequences (the ones left are below)."""
    causes = _independent_signatures("ReleaseIgnoresCache", 150)
    soundness = str(Invariant.CACHE_SOUNDNESS)
    assert causes == {
        (soundness, "a cache hit through an entry that outlived its block's release to the free set"),
        # Left: once another prefix's K/V has landed in the block (what a wrong cache key shows the same way), and a
        # hit on a block whose scheduled writes a preemption withdrew (an entry that names K/V never written).
        (soundness, "a cache hit on a block that holds, or is about to hold, another prefix's K/V"),
        (soundness, "a cache hit on K/V no completed step has written"),
    }


def test_a_pool_whose_counts_do_not_add_up_names_the_block_that_is_listed_wrong() -> None:
    """Issue 45, item 10 (benchmarks/independent's FreeCountOffByOne, whose free set leaves a block out): before, the
    first call failed on the pool's sum and a later one on the block in no set, two findings; now the sum's failure
    names the block, with the block's cause."""
    assert _independent_signatures("FreeCountOffByOne", 60) == {
        (str(Invariant.FREE_SET), "an unreferenced block in none, or several, of the free, cached and pending sets")
    }


def _independent_signatures(name: str, programs: int) -> set[tuple[str, str]]:
    """The (failure, cause) of every signature, keyed by divergence, that ``programs`` seeded random programs of up
    to 40 calls find in benchmarks/independent's one-bug allocator ``name``."""
    from benchmarks.independent import BUGS

    (bug,) = [bug for bug in BUGS if bug.name == name]
    target = Target(bug.factory, MachineConfig())
    rng = random.Random(1)
    found = set()
    for _ in range(programs):
        failed = random_program(target, rng, rng.randint(1, 40))
        if failed is None:
            continue
        outcome = replay(target, failed.calls)
        assert outcome.failure is not None
        signature = signature_of(bug.name, outcome.failure, failed.calls, outcome.failed_at, outcome.diverged)
        found.add((signature.failure, str(signature.cause)))
    return found
