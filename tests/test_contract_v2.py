"""Contract v2 (issue 12): what an allocator does not declare is never called, and the capabilities real engines
need (a refusal that evicts, no preemption, one token per grow, the three behaviours of blocks matchable when
scheduled, a full-prompt hit with the last token recomputed), each checked exactly: a declaration never hides a
nearby real bug."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest
from factories import declaring

from kvfuzz.allocator import (
    AdmitResult,
    Capabilities,
    GrowResult,
    InvalidArgument,
    OutOfBlocks,
    PagedAllocator,
    PoolSpec,
    SequenceExists,
    Slot,
    UnknownSequence,
    Unsupported,
)
from kvfuzz.allocator.features import CAPABILITY_DOC, CapabilityDoc, capability_table
from kvfuzz.allocator.protocol import CAPABILITY_PROTOCOLS, CORE_METHODS, DECLARED_METHODS, declares
from kvfuzz.engine import Engine
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Target
from kvfuzz.program.replay import NotApplicable, replay
from kvfuzz.registry import load_factory
from kvfuzz.runner import run
from kvfuzz.statemachines import MachineConfig
from kvfuzz.zoo.contract import (
    EvictsOnRefusal,
    FullPromptHit,
    OneBlockPerGrow,
    PreemptUnsupported,
    RefusalEvictsReferenced,
)
from kvfuzz.zoo.variants import FalseOutOfBlocks, ImmediateReuse, LeakOnCancel, MatchableAtAllocation, NoCopyOnWrite


class BareAllocator:
    """The least an allocator can be: ``Capabilities()`` and the core methods, nothing optional at all (no
    ``rollback``, ``fork``, ``swap_in``, ``evict``, introspection); each sequence owns its blocks, W = 0."""

    capabilities = Capabilities()
    num_host_blocks = 0

    def __init__(self, spec: PoolSpec) -> None:
        self.block_size, self.num_blocks = spec.block_size, spec.num_blocks
        self.free_list = list(range(spec.num_blocks))  # blocks no sequence holds
        self.tables: dict[str, list[int]] = {}  # live sequence -> its blocks
        self.lengths: dict[str, int] = {}  # live sequence -> its token count

    def _take(self, count: int) -> list[int]:
        if count > len(self.free_list):
            raise OutOfBlocks(f"need {count} blocks, {len(self.free_list)} free")
        taken, self.free_list = self.free_list[:count], self.free_list[count:]
        return taken

    def admit(self, seq, namespace, tokens):
        if seq in self.tables:
            raise SequenceExists(seq)
        if not tokens:
            raise InvalidArgument("no tokens")
        self.tables[seq] = self._take(-(-len(tokens) // self.block_size))
        self.lengths[seq] = len(tokens)
        return AdmitResult(self.tables[seq], num_cached_tokens=0)

    def grow(self, seq, tokens):
        if seq not in self.tables:
            raise UnknownSequence(seq)
        if not tokens:
            raise InvalidArgument("no tokens")
        old, new = self.lengths[seq], self.lengths[seq] + len(tokens)
        self.tables[seq] += self._take(-(-new // self.block_size) - len(self.tables[seq]))
        self.lengths[seq] = new
        table = self.tables[seq]
        return GrowResult([Slot(table[p // self.block_size], p % self.block_size) for p in range(old, new)])

    def free(self, seq):
        if seq not in self.tables:
            raise UnknownSequence(seq)
        self.free_list += self.tables.pop(seq)
        del self.lengths[seq]

    preempt = free

    def step_completed(self, step):
        pass

    def block_table(self, seq):
        if seq not in self.tables:
            raise UnknownSequence(seq)
        return tuple(self.tables[seq])


def test_the_bare_allocator_has_no_optional_method():
    optional = {"rollback", "fork", "swap_out", "swap_in", "evict", "reset_cache", "refcount", "free_blocks"}
    assert not optional & set(dir(BareAllocator))
    assert set(CORE_METHODS) <= set(dir(BareAllocator))


def test_an_allocator_declaring_nothing_is_driven_only_through_its_core_methods():
    """Misuse probes included: rolling back every token is misuse only where rollback exists."""
    summary = run(BareAllocator, MachineConfig(), examples=60)
    assert not summary.failed, summary.explanation
    assert summary.operations["misuse"] > 0 and summary.operations["preempt"] > 0


class StubbedAllocator(BareAllocator):
    """:class:`BareAllocator` as third-party code may still write it: a stub raising ``Unsupported`` for every method
    of a capability it does not declare."""

    def fork(self, parent, child):
        raise Unsupported("fork")

    def swap_out(self, seq):
        raise Unsupported("swap_out")

    swap_in = swap_out

    def rollback(self, seq, num_tokens):
        raise Unsupported("rollback")

    def evict(self, num_blocks):
        raise Unsupported("evict")

    def reset_cache(self):
        raise Unsupported("reset_cache")


def _stubbed_declaring_fork(spec: PoolSpec) -> StubbedAllocator:
    allocator = StubbedAllocator(spec)
    allocator.capabilities = Capabilities(fork=True)
    return allocator


def test_an_allocator_keeping_stubs_for_what_it_does_not_declare_still_runs():
    """The stubs are never called, misuse probes included; declared, the same stub is a valid call refused (11)."""
    summary = run(StubbedAllocator, MachineConfig(), examples=60)
    assert not summary.failed, summary.explanation
    assert summary.operations["misuse"] > 0 and not summary.operations.get("fork")
    declared = run(_stubbed_declaring_fork, MachineConfig(), examples=60, shrink=False)
    assert declared.failed and declared.violated is Invariant.MISUSE, declared.explanation


@pytest.mark.parametrize(
    "name",
    [
        "kvfuzz.allocator.reservation:reservation_allocator",
        "kvfuzz.allocator.hybrid:hybrid_allocator",
        "kvfuzz.adapters.torch_paged:paged_attention",
        "examples.simple_allocator:make_allocator",
    ],
)
def test_a_shipped_allocator_has_no_method_of_a_capability_it_does_not_declare(name):
    allocator = load_factory(name)(PoolSpec(block_size=4, num_blocks=16))
    undeclared = [method for methods in DECLARED_METHODS.values() for method in methods]
    undeclared = [method for method in undeclared if not declares(allocator.capabilities, method)]
    assert {"swap_out", "swap_in"} <= set(undeclared)
    assert [method for method in undeclared if hasattr(allocator, method)] == []


def test_the_methods_of_a_capability_are_its_protocols_and_come_with_its_declaration():
    fields = {field.name for field in attrs.fields(Capabilities)}
    assert set(CAPABILITY_PROTOCOLS) <= fields
    assert not set(CORE_METHODS) & {method for methods in DECLARED_METHODS.values() for method in methods}
    allocator = PagedAllocator(4, 16, 4, inflight_window=1)
    for capability, protocol in CAPABILITY_PROTOCOLS.items():
        if getattr(allocator.capabilities, capability):
            assert isinstance(allocator, protocol), capability
    assert DECLARED_METHODS["swap"] == ("swap_out", "swap_in") and DECLARED_METHODS["eviction"] == (
        "evict",
        "reset_cache",
    )


CONTRACT_PAGE = Path(__file__).resolve().parent.parent / "docs" / "contract.md"


def test_the_capability_table_of_the_contract_page_is_the_fields_metadata():
    """A field missing from docs/contract.md, or a text there that is not the field's, fails here: rewrite the table
    with ``python scripts/samples.py docs/contract.md``."""
    region = re.search(r"^<!-- table: capabilities -->\n(.*?)^<!-- /table -->$", CONTRACT_PAGE.read_text(), re.M | re.S)
    assert region is not None, "docs/contract.md has no capability table region"
    shown = region.group(1)
    fields = attrs.fields(Capabilities)
    assert [field.name for field in fields if f"| `{field.name}` |" not in shown] == []
    assert shown == capability_table(fields), "stale: python scripts/samples.py docs/contract.md"


def test_every_capability_is_documented_in_its_metadata_and_its_docstring_shows_it():
    docstring = " ".join((Capabilities.__doc__ or "").split())
    for field in attrs.fields(Capabilities):
        doc = field.metadata.get(CAPABILITY_DOC)
        assert isinstance(doc, CapabilityDoc) and doc.meaning and doc.declared_by, field.name
        meaning = re.sub(r"`([^`]+)`", r"``\1``", " ".join(doc.meaning.split()))
        assert f"``{field.name}`` (default {field.default!r}): {meaning}." in docstring, field.name


# -- no preemption, and one token per grow ------------------------------------------------------------------------


def test_an_engine_without_preemption_is_never_asked_to_preempt():
    summary = run(declaring(PreemptUnsupported, preemption=False), MachineConfig(), examples=80)
    assert not summary.failed, summary.explanation
    assert summary.operations.get("preempt", 0) == 0 and summary.operations["grow"] > 0


def test_declaring_no_preemption_hides_no_leak_on_the_free_path():
    summary = run(declaring(LeakOnCancel, window=1, preemption=False), MachineConfig(), examples=300, shrink=False)
    assert summary.failed and summary.violated is Invariant.FREE_SET, summary.explanation
    assert "state.preempt(" not in summary.program


def test_a_decode_only_engine_grows_one_token_at_a_time():
    summary = run(declaring(OneBlockPerGrow, single_token_grow=True), MachineConfig(), examples=80)
    assert not summary.failed, summary.explanation
    assert summary.operations["grow"] > 0


def test_declaring_one_token_grows_hides_no_missing_copy_on_write():
    """A decode token into a forked sibling's shared tail is one-token growth too."""
    summary = run(
        declaring(NoCopyOnWrite, window=1, single_token_grow=True), MachineConfig(), examples=300, shrink=False
    )
    assert summary.failed and summary.violated is Invariant.EXCLUSIVE_WRITES, summary.explanation


@pytest.mark.parametrize(
    ("declared", "call"),
    [
        ({"preemption": False}, Call("preempt", {"seq": "s0"})),
        ({"single_token_grow": True}, Call("grow", {"seq": "s0", "tokens": [1, 2, 3]})),
        ({"free_scheduled": False}, Call("free", {"seq": "s0"})),
    ],
    ids=["preempt", "chunk", "abort"],
)
def test_replay_refuses_a_call_the_declaration_rules_out(declared, call):
    """The operation table decides for replay as for both searches: a trace saved against an allocator that did not
    declare these is refused, not run, against one that does."""
    admit = Call("admit", {"seq": "s0", "namespace": (), "system": (), "suffix": [1, 2]})
    target = Target(declaring(PagedAllocator, **declared))
    step, grow = Call("step", {}), Call("grow", {"seq": "s0", "tokens": [3]})
    allowed = [admit, step, grow, step, Call("free", {"seq": "s0"})]
    assert replay(target, allowed).failure is None
    with pytest.raises(NotApplicable, match="cannot be made"):
        replay(target, [admit, call])


# -- a hit never covers the whole prompt, unless the engine recomputes the last token -------------------------------


def _full_hit_engine(cls: type, **declared: object) -> Engine:
    """An engine around ``cls`` in which "a"'s one-block prompt is written, so that "b" with the same prompt hits it."""
    engine = Engine(declaring(cls, **declared)(PoolSpec(4, 8)), MachineConfig(block_size=4, num_blocks=8))
    engine.admit("a", (), (1, 2, 3, 4))
    engine.step()
    return engine


def test_kvfuzz_allocator_recomputes_the_last_token_of_a_fully_cached_prompt_into_a_fresh_block():
    engine = _full_hit_engine(PagedAllocator)
    engine.admit("b", (), (1, 2, 3, 4))
    b, a = engine.expected.seqs["b"], engine.expected.seqs["a"]
    assert b.written == 0 and b.table != a.table
    engine.admit("c", (), (1, 2, 3, 4, 5))
    assert engine.expected.seqs["c"].written == 4 and engine.expected.seqs["c"].table[0] == a.table[0]
    engine.step()
    engine.quiesce()


def test_a_hit_of_the_whole_prompt_is_reported():
    engine = _full_hit_engine(FullPromptHit)
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("b", (), (1, 2, 3, 4))
    assert caught.value.invariant is Invariant.CACHE_SOUNDNESS
    assert "whole prompt (4 tokens)" in caught.value.summary and "query token" in str(caught.value)


def test_an_engine_that_recomputes_the_last_token_in_place_passes():
    summary = run(
        declaring(FullPromptHit, window=1, recomputes_last_token=True, recomputes_in_place=True),
        MachineConfig(),
        examples=80,
    )
    assert not summary.failed, summary.explanation
    assert summary.operations["cache hits"] > 0


def test_a_whole_prompt_hit_recomputed_in_place_inside_its_in_flight_window_is_no_reuse():
    """Before: in a pool of 3 blocks, a request preempted while its block was in flight (W = 1) and readmitted onto
    its own cached block was reported as a block handed out inside its window: the recompute rewrites the K/V the
    block holds, so in-flight work reads the same. A different prompt onto the same block still fails."""
    calls = [
        Call("step", ()),
        Call("admit", (("namespace", ()), ("seq", "s0"), ("suffix", [0, 0, 0, 0]), ("system", ()))),
        Call("step", ()),
        Call("step", ()),
        Call("preempt", (("seq", "s0"),)),
        Call("readmit", (("seq", "s0"),)),
    ]
    declared = {"window": 1, "recomputes_last_token": True, "recomputes_in_place": True}
    assert replay(Target(declaring(FullPromptHit, **declared), MachineConfig(num_blocks=3)), calls).failure is None
    other = [*calls[:5], Call("admit", (("namespace", ()), ("seq", "s1"), ("suffix", [0, 0, 0, 1]), ("system", ())))]
    early = declaring(ImmediateReuse, **declared)  # hands the in-flight block out at once, for other K/V
    failure = replay(Target(early, MachineConfig(num_blocks=1)), other).failure
    assert isinstance(failure, InvariantViolation) and failure.invariant is Invariant.NON_REUSE_WINDOW, failure


def test_a_whole_prompt_hit_recomputed_in_place_onto_a_block_another_request_rolled_back_is_no_shared_write():
    """Before: s0 rolled back its last token (its block still holds that token's K/V, and its cache entry), s1's
    whole-prompt hit recomputed that token in place: reported as a write into a block s0 references, though it
    rewrote the K/V already there."""
    system = (("namespace", ()), ("system", (3, 2, 1)))
    calls = [
        Call("step", ()),
        Call("admit", (*system, ("seq", "s0"), ("suffix", [1]))),
        Call("step", ()),
        Call("step", ()),
        Call("rollback", (("num_tokens", 1), ("seq", "s0"))),
        Call("admit", (*system, ("seq", "s1"), ("suffix", [1]))),
    ]
    declared = {"window": 1, "recomputes_last_token": True, "recomputes_in_place": True}
    assert replay(Target(declaring(FullPromptHit, **declared)), calls).failure is None


def test_declaring_the_recomputed_last_token_hides_no_rewrite_of_a_shared_block():
    """Bug class 9: without recomputes_in_place, the recomputed token lands in a block another request reads."""
    engine = _full_hit_engine(FullPromptHit, recomputes_last_token=True)
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("b", (), (1, 2, 3, 4))
    assert caught.value.invariant is Invariant.EXCLUSIVE_WRITES
    assert "referenced by [('a', 0), ('b', 0)]" in str(caught.value)


def test_a_fully_cached_prompt_of_a_declaring_engine_recomputes_its_last_token():
    engine = _full_hit_engine(FullPromptHit, recomputes_last_token=True)
    engine.free("a")
    engine.admit("b", (), (1, 2, 3, 4))
    assert engine.expected.seqs["b"].written == 3 and "b" not in engine.expected.computed_ids()
    engine.step()
    assert "b" in engine.expected.computed_ids()
    engine.quiesce()


# -- a refusal that evicts ----------------------------------------------------------------------------------------


def test_a_refusal_that_evicts_passes_when_declared():
    summary = run(declaring(EvictsOnRefusal, window=1, refusal_evicts=True), MachineConfig(num_blocks=8), examples=80)
    assert not summary.failed, summary.explanation
    assert summary.operations["refused (out of blocks)"] > 0


def _engine_with_a_cached_block(cls: type, **declared: object) -> Engine:
    """Two blocks: "a" wrote one full block and was freed (it is cached); "b" holds the other."""
    engine = Engine(declaring(cls, **declared)(PoolSpec(4, 2)), MachineConfig(block_size=4, num_blocks=2))
    engine.admit("a", (), (1, 2, 3, 4))
    engine.admit("b", (), (5,))
    engine.step()
    engine.free("a")
    return engine


def test_an_undeclared_refusal_that_evicts_is_not_atomic():
    engine = _engine_with_a_cached_block(EvictsOnRefusal)
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("c", (), (9,) * 12)
    assert caught.value.invariant is Invariant.ATOMIC_REFUSAL


def test_a_declared_refusal_that_evicts_is_counted_and_named_in_the_block_history():
    engine = _engine_with_a_cached_block(EvictsOnRefusal, refusal_evicts=True)
    (cached,) = engine.checks.cached_set()
    assert not engine.admit("c", (), (9,) * 12)
    assert engine.checks.cached_set() == frozenset() and engine.stats["evicted blocks (refusals)"] == 1
    assert any("evicted from the cache by the refused admit" in line for line in engine.pools.block_story(cached))
    engine.quiesce()


def test_declaring_a_refusal_that_evicts_hides_no_referenced_block_freed():
    engine = Engine(RefusalEvictsReferenced(4, 4), MachineConfig(block_size=4, num_blocks=4))
    engine.admit("d", (), (5, 6, 7, 8, 9))
    engine.admit("a", (), (1, 2, 3, 4))
    engine.step()  # d's first block is now cached, and d still references it
    engine.free("a")  # a's block is cached and unreferenced: one free block, one cached
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("c", (), (9,) * 12)
    assert caught.value.invariant is Invariant.ATOMIC_REFUSAL
    assert "evicted cached block" in str(caught.value)


def test_declaring_a_refusal_that_evicts_hides_no_false_refusal():
    """A pool of two free and two cached blocks refuses a three-block prompt: declared or not, that refusal is
    false."""
    allocator = declaring(FalseOutOfBlocks, window=1, refusal_evicts=True)(PoolSpec(4, 4))
    engine = Engine(allocator, MachineConfig(block_size=4, num_blocks=4))
    engine.admit("a", (), (1, 2, 3, 4, 5, 6, 7, 8, 9))
    for _ in range(3):
        engine.step()  # with W = 1, a's two full blocks are cached once the step after their write completes
    engine.free("a")
    for _ in range(2):
        engine.step()  # and settle, cached, once the window of the free closes: two cached blocks, two free
    with pytest.raises(InvariantViolation) as caught:
        engine.admit("b", (), (9,) * 12)
    assert caught.value.invariant is Invariant.NO_FALSE_REFUSAL, caught.value


# -- the three behaviours of a block matchable when scheduled -----------------------------------------------------

VLLM_SCHEDULING = {"preempt_scheduled": False, "rollback": False, "hits_scheduled_writes": True}
"""An FCFS engine that hashes blocks at allocation and keeps rejected drafts' blocks, declaring hits on scheduled
writes; each test adds the other behaviours it claims."""


def test_an_engine_with_no_abort_need_not_claim_that_an_abort_lands_its_writes():
    summary = run(
        declaring(MatchableAtAllocation, shares_scheduled_blocks=True, free_scheduled=False, **VLLM_SCHEDULING),
        MachineConfig(),
        examples=80,
    )
    assert not summary.failed, summary.explanation
    assert summary.operations["free"] > 0 and summary.operations["cache hits"] > 0


def test_each_behaviour_is_its_own_declaration():
    """Hits on scheduled writes without same-round sharing, or with an abort that withdraws them, are caught."""
    admit = [Call("admit", {"seq": "a", "namespace": (), "system": (), "suffix": [1, 2, 3, 0, 1]})]
    hit = [Call("admit", {"seq": "b", "namespace": (), "system": (), "suffix": [1, 2, 3, 0, 2]})]
    for declared, calls, invariant in (
        ({}, admit + hit + [Call("step", {})], Invariant.EXCLUSIVE_WRITES),
        ({"shares_scheduled_blocks": True}, admit + [Call("free", {"seq": "a"})] + hit, Invariant.CACHE_SOUNDNESS),
    ):
        target = Target(declaring(MatchableAtAllocation, **declared, **VLLM_SCHEDULING))
        failure = replay(target, calls).failure
        assert isinstance(failure, InvariantViolation) and failure.invariant is invariant, failure


def test_an_abort_that_lands_its_writes_makes_the_same_program_sound():
    calls = [
        Call("admit", {"seq": "a", "namespace": (), "system": (), "suffix": [1, 2, 3, 0, 1]}),
        Call("free", {"seq": "a"}),
        Call("admit", {"seq": "b", "namespace": (), "system": (), "suffix": [1, 2, 3, 0, 2]}),
        Call("step", {}),
    ]
    declared = {"shares_scheduled_blocks": True, "free_lands_scheduled_writes": True}
    assert replay(Target(declaring(MatchableAtAllocation, **declared, **VLLM_SCHEDULING)), calls).failure is None


def test_declaring_no_abort_hides_no_leak_on_the_finish_path():
    summary = run(declaring(LeakOnCancel, window=1, free_scheduled=False), MachineConfig(), examples=300, shrink=False)
    assert summary.failed and summary.violated is Invariant.FREE_SET, summary.explanation
