"""kvfuzz campaign: swarmed configurations, signatures, shrinking to a fixpoint, workers, known findings, the
distinct-failure table, and bad input. The campaigns here last a few seconds; the Redis ones are in
test_campaign_redis.py."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import types
from pathlib import Path
from typing import Any, Sequence

import attrs
import pytest
from factories import kvfuzz

from kvfuzz.allocator import PagedAllocator, PoolSpec
from kvfuzz.allocator.paged import paged_allocator, synchronous_allocator
from kvfuzz.campaign.known import known_signatures, trace_signature
from kvfuzz.campaign.supervisor import Campaign, CampaignOptions, _Slot
from kvfuzz.campaign.swarm import ALWAYS_ENABLED, MAX_BLOCKS, MAX_PROGRAM_LENGTH, Limits, draw_swarm, probe_limits
from kvfuzz.cli import main
from kvfuzz.engine.config import MachineConfig, config_json
from kvfuzz.engine.misuse import MisuseCall
from kvfuzz.program.arguments import system_prompts
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Safeguards, Target
from kvfuzz.program.operations import BY_NAME, OPERATIONS
from kvfuzz.program.random_programs import random_program, random_search
from kvfuzz.program.replay import NotApplicable, replay
from kvfuzz.program.safeguards import JOURNAL_FORMAT, JOURNAL_PREFIX, AllocatorHang, Watchdog
from kvfuzz.program.stats import RunStats
from kvfuzz.registry import DEFAULT_ALLOCATOR, AllocatorUnusable, load_factory
from kvfuzz.saved.corpus import replay_trace
from kvfuzz.saved.trace import Trace, from_json, load
from kvfuzz.shrink import candidates, configuration, deletions, fixpoint
from kvfuzz.shrink import restarts as restarting
from kvfuzz.shrink.candidates import Pools
from kvfuzz.shrink.fixpoint import shrink
from kvfuzz.shrink.signature import TEARDOWN, Signature, signature_of
from kvfuzz.shrink.simplify import _smaller, renumbered
from kvfuzz.zoo import variant as zoo_variant
from tests.hostile import hangs_on_rollback

REPOSITORY = Path(__file__).resolve().parent.parent


def _picky(spec: PoolSpec) -> PagedAllocator:
    """An allocator that builds only block sizes 2 and 8, and pools of at least 3 blocks."""
    if spec.block_size not in (2, 8) or spec.num_blocks < 3:
        raise ValueError(f"unsupported pool {spec}")
    return PagedAllocator(spec.block_size, spec.num_blocks, spec.num_host_blocks, inflight_window=1)


# -- swarm --------------------------------------------------------------------------------------------------------


def test_swarm_draws_every_geometry_within_what_the_allocator_builds() -> None:
    limits = probe_limits("picky", _picky, MachineConfig())
    assert limits.block_sizes == (2, 8) and limits.min_blocks == 3 and limits.declared_window == 1
    rng = random.Random(0)
    draws = [draw_swarm(rng, limits, MachineConfig()) for _ in range(2000)]
    blocks = [draw.machine.num_blocks for draw in draws]
    assert min(blocks) == 3 and max(blocks) > MAX_BLOCKS // 2
    assert sum(count <= 6 for count in blocks) > len(blocks) * 0.4  # biased toward tiny pools
    assert {draw.machine.block_size for draw in draws} == {2, 8}
    assert {draw.machine.num_host_blocks for draw in draws} >= {0, 1, 4, 20}
    lengths = [draw.program_length for draw in draws]
    assert min(lengths) <= 10 and max(lengths) > MAX_PROGRAM_LENGTH // 2 and max(lengths) <= MAX_PROGRAM_LENGTH
    subsets = {draw.operations for draw in draws}
    assert len(subsets) > 100
    assert all(set(ALWAYS_ENABLED) <= set(subset) for subset in subsets)
    every = tuple(operation.name for operation in OPERATIONS)
    assert every in subsets  # some swarms keep every operation of the table, new ones included
    for name in set(every) - set(ALWAYS_ENABLED):  # and each operation is left out of some
        assert any(name not in subset for subset in subsets)
    for draw in draws[:50]:  # every draw builds
        _picky(draw.machine.pool_spec())


def test_swarm_draws_the_in_flight_window_a_factory_builds_when_asked() -> None:
    limits = probe_limits(DEFAULT_ALLOCATOR, paged_allocator, MachineConfig())
    assert limits.windows == (0, 1, 2, 3)
    rng = random.Random(4)
    draws = [draw_swarm(rng, limits, MachineConfig()) for _ in range(400)]
    assert {draw.machine.inflight_window for draw in draws} == {0, 1, 2, 3}
    for draw in draws[:20]:  # the factory builds the W drawn, and the engine runs it
        built = paged_allocator(draw.machine.pool_spec())
        assert built.capabilities.inflight_window == draw.machine.inflight_window
        assert f"W = {draw.machine.inflight_window}" in draw.describe()
    fixed = probe_limits("kvfuzz-synchronous", synchronous_allocator, MachineConfig())
    assert fixed.windows == () and fixed.declared_window == 0  # a factory that keeps its own W: never swarmed
    assert {draw_swarm(rng, fixed, MachineConfig()).machine.inflight_window for _ in range(50)} == {None}


def test_a_trace_asks_the_factory_for_the_window_it_recorded(tmp_path: Path) -> None:
    old = load(REPOSITORY / "corpus" / "nocopyonwrite-exclusive-writes-b4ceae19c430.json")
    trace = Trace(DEFAULT_ALLOCATOR, MachineConfig(num_blocks=6), old.program, old.failure, declared_window=3)
    assert trace.config.inflight_window is None  # the configuration as given: the file records the declared W
    again = from_json(json.loads(json.dumps(trace.to_json())))
    assert again.config == attrs.evolve(trace.config, inflight_window=3) and again.declared_window == 3
    engine = Target(paged_allocator, again.config).start().engine
    assert engine.caps.inflight_window == 3 and engine.pools.inflight_window == 3


def test_an_allocator_that_builds_no_block_size_is_refused_with_its_reason() -> None:
    def never(spec: PoolSpec) -> PagedAllocator:
        raise ValueError("this allocator is never built")

    with pytest.raises(AllocatorUnusable, match="never built"):
        probe_limits("never", never, MachineConfig())


def test_a_trace_records_the_swarm_and_old_traces_still_load(tmp_path: Path) -> None:
    old = load(REPOSITORY / "corpus" / "nocopyonwrite-exclusive-writes-b4ceae19c430.json")
    assert old.swarm is None
    swarm = {"program_length": 40, "operations": ["admit", "step", "fork"]}
    trace = Trace(old.allocator, MachineConfig(block_size=2, num_blocks=3), old.program, old.failure, swarm=swarm)
    again = from_json(json.loads(json.dumps(trace.to_json())))
    assert again.swarm == swarm and again.config == trace.config
    bad = {**trace.to_json(), "swarm": {"program_length": 40, "operations": ["admit", "frobnicate"]}}
    with pytest.raises(Exception, match=r"swarm.operations\[1\]: \"frobnicate\" is not an operation"):
        from_json(bad, "bad.json")


# -- signatures and shrinking -------------------------------------------------------------------------------------


class _KeyErrorOnThirdAdmit(PagedAllocator):
    def admit(self, seq, namespace, tokens):  # type: ignore[no-untyped-def]
        if len(self._seqs) >= 2:
            return self._lookup_missing(seq)
        return super().admit(seq, namespace, tokens)

    def _lookup_missing(self, seq):  # type: ignore[no-untyped-def]
        return {}[seq]


def test_a_crash_signature_names_the_exception_and_the_allocators_frame() -> None:
    def factory(spec: PoolSpec) -> PagedAllocator:
        return _KeyErrorOnThirdAdmit(spec.block_size, spec.num_blocks, spec.num_host_blocks)

    calls = [Call("admit", {"seq": f"s{i}", "namespace": (), "system": (), "suffix": [1]}) for i in range(3)]
    outcome = replay(Target(factory), calls)
    assert outcome.failure is not None
    signature = signature_of("x", outcome.failure, calls, outcome.failed_at)
    assert signature.failure == "crash (KeyError)"
    assert signature.operation == "admit"
    assert signature.frame == f"{__name__}._KeyErrorOnThirdAdmit._lookup_missing"


def test_a_failure_of_the_teardown_has_the_teardown_as_its_operation() -> None:
    factory = load_factory("zoo:LeakOnCancel")
    calls = [Call("admit", {"seq": "s0", "namespace": (), "system": (), "suffix": [1]}), Call("free", {"seq": "s0"})]
    outcome = replay(Target(factory), calls)
    assert outcome.failure is not None
    assert signature_of("zoo:LeakOnCancel", outcome.failure, calls, outcome.failed_at).operation in ("free", TEARDOWN)


class _KeyErrorOnFree(PagedAllocator):
    """An allocator whose free raises KeyError (as vLLM v0's does for a swapped-out sequence)."""

    def free(self, seq):  # type: ignore[no-untyped-def]
        return {}[seq]


def test_a_crash_while_the_teardown_frees_a_sequence_is_a_crash_in_free() -> None:
    # The same bug, whether the program frees the sequence or leaves it to the teardown: one signature.
    def factory(spec: PoolSpec) -> PagedAllocator:
        return _KeyErrorOnFree(spec.block_size, spec.num_blocks, spec.num_host_blocks)

    admit = Call("admit", {"seq": "s0", "namespace": (), "system": (), "suffix": [1]})
    signatures = []
    for calls in ([admit, Call("free", {"seq": "s0"})], [admit]):
        outcome = replay(Target(factory), calls)
        assert outcome.failure is not None
        signatures.append(signature_of("x", outcome.failure, calls, outcome.failed_at))
    assert signatures[0].operation == "free"
    assert signatures[1] == signatures[0]
    assert signatures[0].frame == f"{__name__}._KeyErrorOnFree.free"


def test_a_quiescence_failure_is_one_of_the_teardown() -> None:
    # Without introspection the leak shows only at the end, when the whole pool cannot be admitted.
    factory = load_factory("zoo:OpaqueLeakOnCancel")
    calls = [Call("admit", {"seq": "s0", "namespace": (), "system": (), "suffix": [1]}), Call("free", {"seq": "s0"})]
    outcome = replay(Target(factory), calls)
    assert outcome.failure is not None and outcome.failed_at == len(calls)
    assert signature_of("zoo:OpaqueLeakOnCancel", outcome.failure, calls, outcome.failed_at).operation == TEARDOWN


def test_a_crash_in_an_installed_library_is_named_by_the_librarys_frame() -> None:
    # A virtual environment's site-packages lie inside its platstdlib (venv/lib/python3.X): a library's frame must not
    # be taken for the standard library's, or every crash of vLLM or SGLang is named by the adapter's method.
    library = Path(sysconfig.get_paths()["purelib"]) / "kvfuzz_test_library" / "pool.py"
    code = compile("def mark_accessed(blocks):\n    return blocks[1]\n", str(library), "exec")
    namespace: dict[str, Any] = {"__name__": "kvfuzz_test_library.pool"}
    exec(code, namespace)

    class CrashesInTheLibrary(PagedAllocator):
        def free(self, seq):  # type: ignore[no-untyped-def]
            return namespace["mark_accessed"]({})

    def factory(spec: PoolSpec) -> PagedAllocator:
        return CrashesInTheLibrary(spec.block_size, spec.num_blocks, spec.num_host_blocks)

    calls = [Call("admit", {"seq": "s0", "namespace": (), "system": (), "suffix": [1]}), Call("free", {"seq": "s0"})]
    outcome = replay(Target(factory), calls)
    assert outcome.failure is not None
    signature = signature_of("x", outcome.failure, calls, outcome.failed_at)
    assert signature.frame == "kvfuzz_test_library.pool.mark_accessed"


def test_renumbering_names_sequences_in_order_of_first_use_in_misuse_calls_too() -> None:
    calls = [
        Call("admit", {"seq": "s7", "namespace": (), "system": (), "suffix": [1]}),
        Call("fork", {"parent": "s7", "child": "s12"}),
        Call("misuse", {"call": MisuseCall("free", ("s12",), "s12 was already freed")}),
    ]
    renamed = renumbered(calls)
    assert renamed[0].kwargs()["seq"] == "s0"
    assert renamed[1].kwargs() == {"parent": "s0", "child": "s1"}
    assert renamed[2].kwargs()["call"] == MisuseCall("free", ("s1",), "s1 was already freed")


def _failing_program(spec: str, seed: int):  # type: ignore[no-untyped-def]
    factory = load_factory(spec)
    limits = probe_limits(spec, factory, MachineConfig())
    rng = random.Random(seed)
    while True:
        swarm = draw_swarm(rng, limits, MachineConfig())
        found = random_program(Target(factory, swarm.machine), rng, swarm.program_length, swarm.operation_records())
        if found is not None and len(found.calls) >= 8:
            return factory, limits, swarm, found


def _shrunk_within_limits(
    spec: str, limits: Limits, config: MachineConfig, calls: Sequence[Call]
) -> tuple[fixpoint.Shrunk, Signature]:
    """``calls`` (which must fail under ``config``) shrunk as a campaign would, within the allocator's limits and
    without restarts, to the fixpoint (a bound no test reaches); with the signature it fails with."""
    factory = load_factory(spec)
    outcome = replay(Target(factory, config), calls)
    assert outcome.failure is not None
    signature = signature_of(spec, outcome.failure, calls, outcome.failed_at)
    shrunk = shrink(
        factory,
        config,
        calls,
        outcome.failure,
        signature,
        seconds=120,
        pools=Pools(limits.min_blocks, limits.block_sizes),
    )
    assert shrunk.stopped_early is None
    return shrunk, signature


@pytest.mark.parametrize("seed", [3, 5])
def test_shrinking_reaches_a_fixpoint_of_calls_arguments_ids_and_pool(seed: int) -> None:
    spec = "zoo:NoCopyOnWrite"
    factory, limits, swarm, found = _failing_program(spec, seed)
    shrunk, signature = _shrunk_within_limits(spec, limits, swarm.machine, found.calls)
    assert len(shrunk.calls) <= 8 < len(found.calls)
    assert shrunk.config.num_host_blocks == 0
    admits = [call.kwargs() for call in shrunk.calls if call.rule == "admit"]
    assert admits[0]["seq"] == "s0" and all(len(admit["suffix"]) == 1 for admit in admits)

    def fails(config: MachineConfig, calls: list[Call]) -> bool:
        try:
            outcome = replay(Target(factory, config), calls)
        except NotApplicable:  # a call the machine could not have drawn there: not a program at all
            return False
        return (
            outcome.failure is not None and signature_of(spec, outcome.failure, calls, outcome.failed_at) == signature
        )

    calls = list(shrunk.calls)
    assert fails(shrunk.config, calls)
    # A fixpoint: no call can go, no argument can be simpler (alone, or shared by several calls at once), and the
    # pool cannot be smaller.
    assert not any(fails(shrunk.config, calls[:index] + calls[index + 1 :]) for index in range(len(calls)))
    for index, call in enumerate(calls):
        for name, value in call.arguments:
            for simpler in _smaller(value):
                trial = calls[:index] + [Call(call.rule, {**call.kwargs(), name: simpler})] + calls[index + 1 :]
                assert not fails(shrunk.config, trial), (index, name, simpler)
    namespaces = {admit["namespace"] for admit in admits}
    assert namespaces == {()}, namespaces  # the namespace the admissions share is simplified in all at once
    if shrunk.config.num_blocks > limits.min_blocks:
        assert not fails(attrs.evolve(shrunk.config, num_blocks=shrunk.config.num_blocks - 1), calls)


class _StandIn:
    """What a shrink pass asks of its shrinker, answered by a model instead of replays: the replays counted, and no
    time bound."""

    def __init__(self, pools: Pools = Pools()) -> None:
        self.replays = 0
        self.pools = pools  # the configurations the configuration passes may try

    def out_of_time(self) -> bool:
        return False

    def failure(self, config: MachineConfig, calls: list[Call]) -> BaseException | None:
        """What the program raises under ``config`` in the model (None: it passes or cannot be made)."""
        raise NotImplementedError

    def fails(self, config: MachineConfig, calls: Sequence[Call], reaim: bool = True) -> candidates._Kept | None:
        failure = self.failure(config, list(calls))
        return None if failure is None else candidates._Kept(config, tuple(calls), failure, 0, {})

    def fails_shorter(self, config: MachineConfig, calls: Sequence[Call]) -> candidates._Kept | None:
        return self.fails(config, calls)


class _PreemptionModel(_StandIn):
    """A stand-in for replays in a test of one deletion pass: a program is applicable when every preempt names a
    running sequence, every readmit a preempted one and every grow a running one, and it fails when it is applicable
    and grows both s0 and s1."""

    def failure(self, config: MachineConfig, calls: list[Call]) -> BaseException | None:
        self.replays += 1
        running: set[str] = set()
        preempted: set[str] = set()
        grown: set[str] = set()
        for call in calls:
            seq = call.kwargs()["seq"]
            if call.rule == "admit":
                running.add(seq)
            elif call.rule == "preempt" and seq in running:
                running.remove(seq)
                preempted.add(seq)
            elif call.rule == "readmit" and seq in preempted:
                preempted.remove(seq)
                running.add(seq)
            elif call.rule == "grow" and seq in running:
                grown.add(seq)
            else:
                return None
        return AssertionError("both grown") if {"s0", "s1"} <= grown else None


def test_shrinking_deletes_a_distant_pair_of_calls_that_only_go_together() -> None:
    """A preempt and its readmit with needed work between them: neither goes alone (the readmit would name a running
    sequence, or s0 would grow while preempted), no window of neighbours covers both, and deleting every call naming
    s0 loses the failure. Only the pair deletion reaches the three calls the failure needs."""
    calls = [Call(rule, {"seq": seq}) for rule, seq in [("admit", "s0"), ("preempt", "s0"), ("admit", "s1")]]
    calls += [Call(rule, {"seq": seq}) for rule, seq in [("grow", "s1"), ("readmit", "s0"), ("grow", "s0")]]
    model = _PreemptionModel()
    assert model.fails(MachineConfig(), calls) is not None
    best = (MachineConfig(), tuple(calls), AssertionError())
    assert deletions.delete_calls(model, best)[:2] == best[:2]  # type: ignore[arg-type]
    _, shrunk, _ = deletions.delete_distant_pairs(model, best)  # type: ignore[arg-type]
    assert [(call.rule, call.kwargs()["seq"]) for call in shrunk] == [
        ("admit", "s0"),
        ("admit", "s1"),
        ("grow", "s1"),
        ("grow", "s0"),
    ]


class _TokensModel(_StandIn):
    """A stand-in for replays in a test of the merging pass: a program is applicable when every grow names an
    admitted sequence, every admit's suffix has at most 3 tokens and every grow at most 2 (the operations' bounds),
    and it fails when it is applicable, s0 ends with at least 4 tokens and a step (or a decode, which ends with one)
    comes after s0's admission."""

    def failure(self, config: MachineConfig, calls: list[Call]) -> BaseException | None:
        self.replays += 1
        lengths: dict[str, int] = {}
        stepped = False
        for call in calls:
            arguments = call.kwargs()
            if call.rule == "admit" and len(arguments["suffix"]) <= 3:
                lengths[arguments["seq"]] = len(arguments["suffix"])
            elif call.rule == "grow" and arguments["seq"] in lengths and len(arguments["tokens"]) <= 2:
                lengths[arguments["seq"]] += len(arguments["tokens"])
            elif call.rule in ("step", "decode"):
                stepped = stepped or "s0" in lengths
            else:
                return None
        return AssertionError("s0 long and stepped") if stepped and lengths.get("s0", 0) >= 4 else None


def _admit(seq: str, suffix: list[int]) -> Call:
    return Call("admit", {"seq": seq, "namespace": (), "system": (), "suffix": suffix})


def test_a_deleted_chunk_takes_the_later_calls_of_the_sequences_it_brought_in() -> None:
    """Deleting s1's admission alone leaves calls that name a sequence never admitted (no replay could make them):
    with it go s1's grow and free, the fork of s2 from s1, and s2's grow; s0's calls stay."""
    calls = [_admit("s0", [0]), _admit("s1", [1]), Call("grow", {"seq": "s1", "tokens": [2]})]
    calls += [Call("fork", {"parent": "s1", "child": "s2"}), Call("grow", {"seq": "s2", "tokens": [3]})]
    calls += [Call("grow", {"seq": "s0", "tokens": [4]}), Call("free", {"seq": "s1"}), Call("step", {})]
    kept = deletions._without_chunk(calls, 1, 2)
    assert kept == [calls[0], calls[5], calls[7]]
    assert deletions._without_chunk(calls, 2, 3) == calls[:2] + calls[3:]  # a grow brings no sequence in


def test_a_candidate_is_the_calls_that_can_be_made_where_they_stand() -> None:
    """A deletion can leave a call that could not be made where it now stands (a readmission of a sequence whose
    preemption went with the deletion, an eviction of a block no longer released): the candidate is replayed
    without it, its failing call named in the calls made, and is kept as those calls. Here s0's readmission names
    a running sequence."""
    spec = "zoo:NoCopyOnWrite"
    factory = load_factory(spec)
    config = MachineConfig(block_size=4, num_blocks=16, num_host_blocks=0, inflight_window=1)
    bug = [_admit("s0", [0]), Call("step", {}), Call("fork", {"parent": "s0", "child": "s1"})]
    bug += [Call("grow", {"seq": "s0", "tokens": [0]})]
    outcome = replay(Target(factory, config), bug)
    assert outcome.failure is not None and outcome.failed_at == 3
    signature = signature_of(spec, outcome.failure, bug, outcome.failed_at)
    candidate = bug[:2] + [Call("readmit", {"seq": "s0"})] + bug[2:]
    with pytest.raises(NotApplicable):
        replay(Target(factory, config), candidate)
    shrinker = candidates.Shrinker(config, factory, signature, Safeguards(), 60, lambda: False, None)
    kept = shrinker.fails(config, candidate)
    assert kept is not None and list(kept.calls) == bug


def test_a_long_program_whose_deletions_strand_calls_shrinks_in_few_replays() -> None:
    """A program a campaign found against zoo:WindowInPoolBlocks (222 calls in 51 blocks, with preemptions the pool
    forced, targeted evictions and readmissions): nearly every deletion leaves some later call that could not be
    made there. Thrown away, such candidates were 535 of the 839 replays it took to reach 4 calls (44 s on a
    2-core machine, past the campaign's 30 s bound); replayed without the stranded calls they shrink it to the
    bug's 3 or 4 calls in a few hundred."""
    trace = load(Path(__file__).parent / "data" / "windowinpoolblocks-as-found.json")
    factory = load_factory(trace.allocator)
    limits = probe_limits(trace.allocator, factory, trace.config)
    shrunk, signature = _shrunk_within_limits(trace.allocator, limits, trace.config, trace.program)
    assert len(shrunk.calls) <= 4 and shrunk.replays <= 300, (len(shrunk.calls), shrunk.replays)
    again = replay(Target(factory, shrunk.config), shrunk.calls)  # the calls made: it replays exactly, as saved
    assert again.failure is not None
    assert signature_of(trace.allocator, again.failure, shrunk.calls, again.failed_at) == signature


def test_shrinking_merges_grows_into_their_admission_within_the_operations_bounds() -> None:
    """No single call of these five goes (each grow carries a token s0 needs, the step is the only one): merging
    reaches the three calls a program needs when an admission carries at most 3 tokens, and never a longer
    suffix."""
    calls = [_admit("s0", [0]), Call("grow", {"seq": "s0", "tokens": [1]}), Call("step", {})]
    calls += [Call("grow", {"seq": "s0", "tokens": [2]}), Call("grow", {"seq": "s0", "tokens": [3]})]
    model = _TokensModel()
    assert model.fails(MachineConfig(), calls) is not None
    _, deleted, _ = deletions.delete_calls(model, (MachineConfig(), tuple(calls), AssertionError()))  # type: ignore[arg-type]
    assert list(deleted) == calls
    _, merged, _ = deletions.merge_calls(model, (MachineConfig(), tuple(calls), AssertionError()))  # type: ignore[arg-type]
    assert list(merged) == [_admit("s0", [0, 1, 2]), Call("step", {}), Call("grow", {"seq": "s0", "tokens": [3]})]


def test_shrinking_merges_two_grows_of_one_sequence_into_one() -> None:
    calls = [_admit("s0", [0, 0, 0]), Call("step", {}), Call("grow", {"seq": "s0", "tokens": [1]})]
    calls += [_admit("s1", [0]), Call("grow", {"seq": "s0", "tokens": [2]})]
    model = _TokensModel()
    assert model.fails(MachineConfig(), calls) is not None
    _, merged, _ = deletions.merge_calls(model, (MachineConfig(), tuple(calls), AssertionError()))  # type: ignore[arg-type]
    assert list(merged) == [
        _admit("s0", [0, 0, 0]),
        Call("step", {}),
        Call("grow", {"seq": "s0", "tokens": [1, 2]}),
        _admit("s1", [0]),
    ]


def test_shrinking_replaces_a_decode_by_a_step_when_its_tokens_do_not_matter() -> None:
    calls = [_admit("s0", [0, 0, 0]), Call("grow", {"seq": "s0", "tokens": [0]}), Call("decode", {"token": 2})]
    model = _TokensModel()
    assert model.fails(MachineConfig(), calls) is not None
    _, merged, _ = deletions.merge_calls(model, (MachineConfig(), tuple(calls), AssertionError()))  # type: ignore[arg-type]
    assert list(merged) == [_admit("s0", [0, 0, 0]), Call("grow", {"seq": "s0", "tokens": [0]}), Call("step", {})]


class _PressureModel(_StandIn):
    """A stand-in for replays in a test of shrinking the pool and the calls together: each admission takes one
    block, and a program fails when its admissions fill the pool and the last one finds it full (exactly
    ``num_blocks + 1`` admissions); with fewer, nothing fails, and with more an earlier one was refused first."""

    def failure(self, config: MachineConfig, calls: list[Call]) -> BaseException | None:
        self.replays += 1
        full = len(calls) == config.num_blocks + 1
        return AssertionError("the last admission found the pool full") if full else None


def test_shrinking_takes_a_smaller_pool_and_one_call_fewer_together() -> None:
    """Neither a smaller pool alone nor one admission fewer alone keeps the failure; both together do, down to the
    smallest pool the factory builds."""
    calls = tuple(_admit(f"s{index}", [0]) for index in range(5))
    config = MachineConfig(block_size=1, num_blocks=4, num_host_blocks=0)
    model = _PressureModel(Pools(min_blocks=2))
    best = (config, calls, AssertionError())
    assert configuration.simplify_config(model, best)[:2] == best[:2]  # type: ignore[arg-type]
    assert deletions.delete_calls(model, best)[:2] == best[:2]  # type: ignore[arg-type]
    while True:
        smaller = configuration.smaller_pool_fewer_calls(model, best)  # type: ignore[arg-type]
        if smaller[:2] == best[:2]:
            break
        best = smaller
    assert best[0].num_blocks == 2 and len(best[1]) == 3


class _BlockSizeModel(_StandIn):
    """A stand-in for replays in a test of shrinking the block size: a program is applicable when every admission's
    system prompt is one the admit operation draws at the pool's block size and its suffix within the operation's
    bounds, and it fails when s0's system prompt is one whole block and its prompt spans two blocks."""

    def failure(self, config: MachineConfig, calls: list[Call]) -> BaseException | None:
        self.replays += 1
        size = config.block_size
        for call in calls:
            arguments = call.kwargs()
            if tuple(arguments["system"]) not in system_prompts(size) or not 1 <= len(arguments["suffix"]) <= size + 2:
                return None
        s0 = calls[0].kwargs()
        tokens = len(s0["system"]) + len(s0["suffix"])
        return AssertionError("two blocks") if len(s0["system"]) == size and -(-tokens // size) == 2 else None


def test_shrinking_the_block_size_carries_system_prompts_and_token_lists_to_the_smaller_size() -> None:
    """The system prompt drawn at one block size is no prompt at another, so the block size alone never shrinks;
    with the prompt of the same role (one whole block) and the suffix scaled to the same number of blocks, it
    shrinks to the smallest size the factory builds."""
    one_block = next(prompt for prompt in system_prompts(8) if len(prompt) == 8)
    calls = (Call("admit", {"seq": "s0", "namespace": (), "system": one_block, "suffix": [0, 1, 2]}),)
    config = MachineConfig(block_size=8, num_blocks=4, num_host_blocks=0)
    model = _BlockSizeModel(Pools(1, (1, 2, 4, 8)))
    assert model.fails(config, list(calls)) is not None
    assert model.fails(attrs.evolve(config, block_size=4), list(calls)) is None
    shrunk_config, shrunk, _ = configuration.simplify_config(model, (config, calls, AssertionError()))  # type: ignore[arg-type]
    assert shrunk_config.block_size == 1
    assert shrunk[0].kwargs()["system"] == next(prompt for prompt in system_prompts(1) if len(prompt) == 1)
    assert shrunk[0].kwargs()["suffix"] == [0]


def _shrunk_by_replays(spec: str, config: MachineConfig, calls: list[Call]) -> fixpoint.Shrunk:
    """``calls`` (which must fail under ``config``) shrunk by real replays, without restarts: what the passes alone
    reach."""
    factory = load_factory(spec)
    outcome = replay(Target(factory, config), calls)
    assert outcome.failure is not None
    signature = signature_of(spec, outcome.failure, calls, outcome.failed_at)
    shrunk = shrink(factory, config, calls, outcome.failure, signature, seconds=60, pools=Pools(1, (1,)))
    assert shrunk.stopped_early is None
    again = replay(Target(factory, shrunk.config), shrunk.calls)  # the result replays exactly, as saved
    assert again.failure is not None
    assert signature_of(spec, again.failure, shrunk.calls, again.failed_at) == signature
    return shrunk


def test_shrinking_reaims_a_targeted_eviction_at_the_block_that_now_holds_what_it_evicted() -> None:
    """Three admissions that do not matter put s0's first block at id 9; deleting any of them moves s0's blocks, so
    the eviction of block 9 would name a block s0 never had (or none released) and no deletion could be kept. Each
    replay re-aims it at the block holding what block 9 held, and the program shrinks to the bug's five calls in a
    pool of the two blocks s0 needs."""
    calls = [_admit("s1", [1, 1, 1]), _admit("s2", [2, 2, 2]), _admit("s3", [3, 3, 3]), _admit("s0", [0, 0])]
    calls += [Call("step", {}), Call("preempt", {"seq": "s0"}), Call("evict_blocks", {"blocks": [9]})]
    calls += [Call("readmit", {"seq": "s0"})]
    config = MachineConfig(block_size=1, num_blocks=16, num_host_blocks=0, inflight_window=0)
    shrunk = _shrunk_by_replays("zoo:EvictBlocksKeepsEntry", config, calls)
    assert [call.rule for call in shrunk.calls] == ["admit", "step", "preempt", "evict_blocks", "readmit"]
    assert shrunk.config.num_blocks == 2
    assert shrunk.calls[3].kwargs()["blocks"] == [0]  # s0's first block in the two-block pool


def test_shrinking_a_program_under_pool_pressure_deletes_calls_and_blocks_together() -> None:
    """The stale entry needs the pool full when s4 is admitted; the decodes fill it three blocks at a time, so
    deleting a decode alone empties the pressure, and a pool one block smaller (or half) does not restore it. A
    deletion is tried in a pool as much smaller than what the candidate maps in a roomy pool as the program's was,
    and the program shrinks to the bug's seven calls in two blocks (without that, it stays at 14 calls and 15
    blocks)."""
    calls = [_admit("s0", [3]), Call("step", {}), Call("preempt", {"seq": "s0"})]
    calls += [_admit("s1", [1]), _admit("s2", [2]), _admit("s3", [1, 2]), Call("step", {})]
    calls += [Call("decode", {"token": 0})] * 3
    calls += [_admit("s4", [0, 0]), Call("step", {}), Call("preempt", {"seq": "s4"}), _admit("s5", [3, 0])]
    config = MachineConfig(block_size=1, num_blocks=15, num_host_blocks=0, inflight_window=0)
    shrunk = _shrunk_by_replays("zoo:StaleEntryAfterPressureEviction", config, calls)
    assert len(shrunk.calls) == 7 and "decode" not in {call.rule for call in shrunk.calls}
    assert shrunk.config.num_blocks == 2


class _MostOfThePoolModel(_StandIn):
    """A stand-in for replays: the program fails only while the pool keeps at least 130 of its blocks."""

    def failure(self, config: MachineConfig, calls: list[Call]) -> BaseException | None:
        self.replays += 1
        return AssertionError("needs 130 blocks") if config.num_blocks >= 130 else None


def test_shrinking_a_pool_that_must_keep_most_of_its_blocks_halves_the_distance() -> None:
    config = MachineConfig(block_size=1, num_blocks=149, num_host_blocks=0)
    model = _MostOfThePoolModel()
    shrunk_config, _, _ = configuration.simplify_config(model, (config, (_admit("s0", [0]),), AssertionError()))  # type: ignore[arg-type]
    assert shrunk_config.num_blocks == 130
    assert model.replays <= 40  # one block at a time would take 19 rounds of 3 candidates and more


EVICTS_ON_REFUSAL_FOUND = [
    # A program a campaign found against zoo:EvictsOnRefusal (block size 1, 4 blocks, W = 1). The passes alone take
    # it to 9 calls (11 before stranded calls were skipped), a fixpoint: no call goes alone, and the pool, the W and
    # the prompts cannot be smaller.
    _admit("s0", [0]),
    Call("preempt", {"seq": "s0"}),
    Call("step", {}),
    Call("readmit", {"seq": "s0"}),
    Call("step", {}),
    Call("step", {}),
    Call("preempt", {"seq": "s0"}),
    Call("step", {}),
    Call("admit", {"seq": "s1", "namespace": (), "system": (1,), "suffix": [0, 0]}),
    Call("preempt", {"seq": "s1"}),
    Call("readmit", {"seq": "s1"}),
]


def test_a_long_fixpoint_is_shrunk_again_from_other_failing_programs_of_the_swarm() -> None:
    spec = "zoo:EvictsOnRefusal"
    factory = load_factory(spec)
    limits = probe_limits(spec, factory, MachineConfig())
    config = MachineConfig(block_size=1, num_blocks=4, num_host_blocks=0, inflight_window=1)
    outcome = replay(Target(factory, config), EVICTS_ON_REFUSAL_FOUND)
    assert outcome.failure is not None
    signature = signature_of(spec, outcome.failure, EVICTS_ON_REFUSAL_FOUND, outcome.failed_at)
    assert signature.failure == "invariant 7 (atomic refusal)"
    bounds = {"seconds": 120.0, "pools": Pools(limits.min_blocks, limits.block_sizes)}
    alone = shrink(factory, config, EVICTS_ON_REFUSAL_FOUND, outcome.failure, signature, **bounds)  # type: ignore[arg-type]
    assert alone.stopped_early is None and alone.restarts == 0
    assert len(alone.calls) > restarting.LONG_PROGRAM  # 9 calls: the passes' fixpoint
    swarm = ("admit", "step", "readmit", "grow", "preempt", "fork", "swap_out")
    restarts = restarting.Restarts(tuple(BY_NAME[name] for name in swarm), 109, random.Random(0))
    again = shrink(factory, config, EVICTS_ON_REFUSAL_FOUND, outcome.failure, signature, restarts=restarts, **bounds)  # type: ignore[arg-type]
    assert again.stopped_early is None and again.restarts >= 1
    assert len(again.calls) < len(alone.calls), len(again.calls)
    rerun = replay(Target(factory, again.config), again.calls)
    assert rerun.failure is not None
    assert signature_of(spec, rerun.failure, again.calls, rerun.failed_at) == signature


def test_a_restart_search_draws_short_programs_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A short failing program is a better start than one of the swarm's full length (and a short passing one is a
    cheap miss): the search's programs grow by a call each, from 8 calls to the swarm's length."""
    asked: list[int] = []

    def passing(target: Target, rng: random.Random, length: int, operations: object) -> None:
        asked.append(length)
        return None

    monkeypatch.setattr(restarting, "random_program", passing)
    wanted = Signature("kvfuzz", "invariant 13 (eviction order)", "evict")
    shrinker = candidates.Shrinker(MachineConfig(), paged_allocator, wanted, Safeguards(), 120.0, lambda: False, None)
    restarts = restarting.Restarts(OPERATIONS, 12, random.Random(0))
    assert restarting.another_program(shrinker, MachineConfig(), (), restarts, []) is None
    assert asked[:6] == [8, 9, 10, 11, 12, 12] and len(asked) == restarting.RESTART_SEARCH


def test_a_restart_search_hands_back_the_failures_of_other_signatures_once_each() -> None:
    spec = "zoo:NoCopyOnWrite"
    factory = load_factory(spec)
    wanted = Signature(spec, "invariant 13 (eviction order)", "evict")  # a failure this variant never has
    shrinker = candidates.Shrinker(MachineConfig(), factory, wanted, Safeguards(), 120.0, lambda: False, None)
    others: list[restarting.Failing] = []
    restarts = restarting.Restarts(OPERATIONS, 60, random.Random(0))
    assert restarting.another_program(shrinker, MachineConfig(), (), restarts, others) is None
    assert others and len({other.signature for other in others}) == len(others)
    assert "invariant 5 (exclusive writes)" in {other.signature.failure for other in others}
    for other in others:
        rerun = replay(Target(factory, other.config), other.calls)
        assert rerun.failure is not None
        assert signature_of(spec, rerun.failure, other.calls, rerun.failed_at) == other.signature


def _even_pools_only(spec: PoolSpec) -> PagedAllocator:
    """The zoo's NoCopyOnWrite, built only for even counts of blocks (an allocator whose sectors pair blocks)."""
    if spec.num_blocks % 2:
        raise ValueError(f"{spec.num_blocks} blocks: an even count only")
    return zoo_variant("NoCopyOnWrite").factory()(spec)


def test_shrinking_never_takes_a_pool_the_factory_refuses() -> None:
    config = MachineConfig(block_size=2, num_blocks=10, num_host_blocks=0)
    found = random_search(Target(_even_pools_only, config), examples=200, steps=40, seed=0)
    assert found is not None
    outcome = replay(Target(_even_pools_only, config), found.calls)
    assert outcome.failure is not None
    signature = signature_of("even", outcome.failure, found.calls, outcome.failed_at)
    shrunk = shrink(_even_pools_only, config, found.calls, outcome.failure, signature, seconds=120, pools=Pools())
    assert shrunk.stopped_early is None
    assert shrunk.config.num_blocks % 2 == 0 and shrunk.config.num_blocks < 10


def test_a_restart_search_that_meets_a_hang_hands_it_back_and_stops() -> None:
    wanted = Signature("hangs", "invariant 13 (eviction order)", "evict")  # a failure this allocator never has
    stats = RunStats()
    with Watchdog(0.5) as watchdog:
        shrinker = candidates.Shrinker(
            MachineConfig(), hangs_on_rollback, wanted, Safeguards(None, watchdog), 120.0, lambda: False, stats
        )
        others: list[restarting.Failing] = []
        operations = tuple(BY_NAME[name] for name in ("admit", "step", "rollback"))
        restarts = restarting.Restarts(operations, 30, random.Random(0))
        assert restarting.another_program(shrinker, MachineConfig(), (), restarts, others) is None
    (hang,) = [other for other in others if isinstance(other.failure, AllocatorHang)]
    assert hang.signature.failure == "hang" and hang.signature.operation == "rollback"
    assert hang.calls and hang.calls[-1].rule == "rollback"


def test_shrinking_says_when_its_time_bound_stopped_it() -> None:
    spec = "zoo:NoCopyOnWrite"
    factory, limits, swarm, found = _failing_program(spec, 3)
    outcome = replay(Target(factory, swarm.machine), found.calls)
    assert outcome.failure is not None
    signature = signature_of(spec, outcome.failure, found.calls, outcome.failed_at)
    shrunk = shrink(factory, swarm.machine, found.calls, outcome.failure, signature, seconds=0.0)
    assert shrunk.stopped_early == "shrinking stopped early: its time bound (0 s) ran out"
    assert list(shrunk.calls) == list(found.calls)


# -- campaigns ----------------------------------------------------------------------------------------------------


def _campaign(tmp_path: Path, *args: str, **kwargs: Any) -> tuple[subprocess.CompletedProcess, dict]:
    done = kvfuzz("campaign", "--json", "--known", str(tmp_path / "no-known"), *args, cwd=tmp_path, **kwargs)
    assert done.stdout, done.stderr
    return done, json.loads(done.stdout)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "no-known").mkdir()
    return tmp_path


def test_a_campaign_against_two_bugs_reports_both_each_shrunk_and_replayable(workdir: Path) -> None:
    done, result = _campaign(
        workdir,
        "--allocator",
        "kvfuzz.zoo.combined:shallow_and_deep",
        "--max-examples",
        "400",  # 150 missed the swap-in bug under seed 0 and 2 once contract v2 changed the draws; 400 met both
        "--workers",
        "1",
        "--seed",
        "0",  # one worker and an example budget: the same programs whatever the machine's load
        "--shrink-time",
        "20",
    )
    assert done.returncode == 1, done.stderr
    assert result["ended_by"] == "max-examples" and result["examples"] > 0
    shown = {"NoCopyOnWrite": 0, "SwapInWrongHostBlock": 0}
    for failure in result["failures"]:
        assert failure["trace"] is not None and failure["shrunk_length"] is not None
        assert failure["seen"] >= 1 and failure["first_seconds"] <= result["seconds"]
        trace = load(workdir / failure["trace"])
        assert trace.swarm is not None and len(trace.program) == failure["shrunk_length"]
        assert replay_trace(trace).reproduced
        for variant in shown:
            shown[variant] += replay_trace(trace, f"zoo:{variant}").reproduced
    assert shown["NoCopyOnWrite"] >= 1, result["failures"]
    assert shown["SwapInWrongHostBlock"] >= 1, result["failures"]
    keys = [json.dumps(failure["signature"], sort_keys=True) for failure in result["failures"]]
    assert len(keys) == len(set(keys))  # each signature once, however often it was met


def test_a_campaign_against_the_correct_allocator_runs_clean(workdir: Path) -> None:
    done, result = _campaign(workdir, "--duration", "4", "--workers", "2", "--seed", "1")
    assert done.returncode == 0, done.stderr
    assert result["failures"] == [] and result["known"] == [] and result["examples"] > 10
    assert result["allocators"] == ["kvfuzz.allocator.paged:paged_allocator"]


def test_a_pool_the_factory_refuses_is_drawn_again_not_a_dead_worker(workdir: Path) -> None:
    # The probe before the campaign builds pools of 1, 2, 3, 4, 6, 8 and 16 blocks; the swarm draws any count.
    done, result = _campaign(
        workdir,
        "--allocator",
        "tests.factories:even_pools_only",
        "--max-examples",
        "60",
        "--workers",
        "1",
        "--seed",
        "3",
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 0, done.stderr
    assert result["errors"] == [] and result["failures"] == [], result
    assert result["ended_by"] == "max-examples" and result["examples"] == 60


def test_stop_after_and_max_examples_end_the_campaign(workdir: Path) -> None:
    done, result = _campaign(
        workdir, "--allocator", "zoo:NoCopyOnWrite", "--stop-after", "1", "--workers", "1", "--seed", "3"
    )
    assert done.returncode == 1, done.stderr
    assert result["ended_by"] == "stop-after" and len(result["failures"]) == 1
    assert result["failures"][0]["shrunk_length"] <= 5
    done, result = _campaign(workdir, "--max-examples", "30", "--workers", "2", "--seed", "3")
    assert done.returncode == 0, done.stderr
    assert result["ended_by"] == "max-examples" and 10 <= result["examples"] <= 30


def test_known_findings_of_the_corpus_are_counted_not_reported_as_new(workdir: Path) -> None:
    corpus = REPOSITORY / "corpus"
    done = kvfuzz(
        "campaign",
        "--json",
        "--known",
        str(corpus),
        "--allocator",
        "zoo:NoCopyOnWrite",
        "--max-examples",
        "60",
        "--workers",
        "1",
        "--seed",
        "1",  # one worker and an example budget: the same programs on every machine, whatever its load
        cwd=workdir,
    )
    result = json.loads(done.stdout)
    known = {(entry["signature"]["failure"], entry["signature"]["operation"]): entry for entry in result["known"]}
    new = {(entry["signature"]["failure"], entry["signature"]["operation"]) for entry in result["failures"]}
    signature = ("invariant 5 (exclusive writes)", "grow")
    assert signature in known, result
    assert signature not in new
    assert "nocopyonwrite-exclusive-writes-b4ceae19c430.json (known bug:" in known[signature]["known"]
    assert known[signature]["seen"] >= 1


def test_a_known_finding_carries_over_only_to_allocators_of_the_traces_class(tmp_path: Path) -> None:
    # The corpus trace was recorded against zoo:NoCopyOnWrite; the campaign runs the same class at another W, and a
    # copy of the slip in another class. Both fail the trace's program the same way; only the first runs its code.
    trace = REPOSITORY / "corpus" / "nocopyonwrite-exclusive-writes-b4ceae19c430.json"
    shutil.copy(trace, tmp_path)
    same_class, other_class = "factories:no_copy_on_write_deferred_free", "factories:no_copy_on_write_copy"
    recorded = trace_signature(load(trace), 10.0)
    assert recorded is not None and recorded.allocator == "zoo:NoCopyOnWrite"
    for spec in (same_class, other_class):
        found = trace_signature(attrs.evolve(load(trace), allocator=spec), 10.0)
        assert found is not None and (found.failure, found.operation) == (recorded.failure, recorded.operation)

    known = known_signatures([tmp_path], [same_class, other_class], 10.0)

    same = trace_signature(attrs.evolve(load(trace), allocator=same_class), 10.0)
    other = trace_signature(attrs.evolve(load(trace), allocator=other_class), 10.0)
    assert same is not None and other is not None
    assert same.key() in known
    assert "recorded against zoo:NoCopyOnWrite" in known[same.key()]
    assert other.key() not in known
    assert recorded.key() not in known  # the recorded allocator is not in the campaign


def test_the_table_lists_each_distinct_failure_with_its_trace(workdir: Path) -> None:
    done = kvfuzz(
        "campaign",
        "--known",
        str(workdir / "no-known"),
        "--allocator",
        "zoo:NoCopyOnWrite",
        "--stop-after",
        "1",
        "--workers",
        "1",
        "--seed",
        "3",
        cwd=workdir,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "kvfuzz campaign: zoo:NoCopyOnWrite"
    header = lines.index("new failures:") + 1
    assert lines[header].split() == ["signature", "first", "found", "seen", "shrunk", "trace"]
    row = lines[header + 1]
    assert row.strip().startswith("invariant ") and ".kvfuzz/corpus/nocopyonwrite-" in row and " calls " in row
    assert "replay it with: kvfuzz replay .kvfuzz/corpus/" in done.stdout
    assert "examples" in done.stderr and "steps/s" in done.stderr  # the progress line


def test_a_worker_the_allocator_kills_is_reported_with_its_program_and_replaced(workdir: Path) -> None:
    done, result = _campaign(
        workdir,
        "--allocator",
        "tests.hostile:segfaults_on_rollback",
        "--duration",
        "15",
        "--workers",
        "2",
        "--seed",
        "4",
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 1, done.stderr
    assert result["dead_workers"], result
    dead = result["dead_workers"][0]
    assert dead["how"] == "killed by signal 11 (SIGSEGV)"
    for dead in result["dead_workers"]:
        assert dead["trace"], (dead, done.stderr)  # each death's program recovered from its journal
        trace = load(workdir / dead["trace"])
        assert trace.program[-1].rule in ("rollback", "misuse")  # a misuse call of rollback segfaults too
    died = "crash (the process died)"
    deaths = [failure for failure in result["failures"] if failure["signature"]["failure"] == died]
    assert {death["signature"]["operation"] for death in deaths} <= {"rollback", "misuse"}
    assert sum(death["seen"] for death in deaths) == len(result["dead_workers"])  # each death saved once
    assert {death["trace"] for death in deaths} == {dead["trace"] for dead in result["dead_workers"]}
    assert result["examples"] > 0 and result["ended_by"] == "duration"  # the campaign went on
    assert "replaced" in done.stderr


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_two_workers_dying_between_two_checks_each_keep_their_program(tmp_path: Path) -> None:
    """The first death recovers every journal of a dead process, the second worker's too: the second death must
    still be reported with the trace its journal became, not as lost."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    config = config_json(MachineConfig(block_size=4, num_blocks=8), None)
    pids = [_dead_pid(), _dead_pid()]
    for pid, seq in zip(pids, ("s0", "s1")):
        header = {"format": JOURNAL_FORMAT, "pid": pid, "allocator": DEFAULT_ALLOCATOR, "config": config}
        call = {"rule": "admit", "arguments": {"seq": seq, "namespace": [], "system": [], "suffix": [1, 2]}}
        lines = [json.dumps(header), json.dumps({"example": 1}), json.dumps(call)]
        (corpus / f"{JOURNAL_PREFIX}{pid}.jsonl").write_text("\n".join(lines) + "\n")
    limits = probe_limits(DEFAULT_ALLOCATOR, load_factory(DEFAULT_ALLOCATOR), MachineConfig())
    campaign = Campaign(CampaignOptions((DEFAULT_ALLOCATOR,), (limits,), 1, corpus, duration=1.0))
    campaign.stop.set()  # no replacement workers
    for number, pid in enumerate(pids):
        process = types.SimpleNamespace(pid=pid)
        campaign._died(number, _Slot(process, 0, 0.0), "killed by signal 11 (SIGSEGV)")
    traces = [dead.trace for dead in campaign.tally.dead]
    assert all(traces), campaign.tally.dead
    assert all(Path(trace).exists() for trace in traces if trace)
    # The same death (a crash in admit) is saved once; the second is counted against it.
    [finding] = campaign.tally.findings.values()
    assert finding.seen == 2 and finding.trace == traces[0] == traces[1]


def test_a_hang_is_a_finding_of_its_own_shrunk_confirmed_and_saved_and_the_campaign_goes_on(workdir: Path) -> None:
    done, result = _campaign(
        workdir,
        "--allocator",
        "tests.hostile:hangs_on_rollback",
        "--duration",
        "12",
        "--workers",
        "1",
        "--seed",
        "4",
        "--call-timeout",
        "0.5",
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 1, done.stderr
    hangs = [failure for failure in result["failures"] if failure["signature"]["failure"] == "hang"]
    assert hangs, result
    assert {hang["signature"]["operation"] for hang in hangs} <= {"rollback", "misuse"}
    for hang in hangs:  # shrunk like any finding (to its fixpoint), and confirmed
        assert hang["note"] is None and hang["reproduced"] == hang["replays"] == 2, hang
        program = load(workdir / hang["trace"]).program
        assert program[-1].rule in ("rollback", "misuse") and len(program) <= 4, program
    assert result["dead_workers"] == [] and result["ended_by"] == "duration"


def test_the_default_corpus_is_not_collected_by_pytest_in_a_checkout(tmp_path: Path) -> None:
    """A campaign run from the root of a checkout (kvfuzz's own: ``testpaths`` lists ``corpus``) saves its traces
    where pytest does not collect them; the same trace in the collected corpus would be a failing test."""
    (tmp_path / "corpus").mkdir()
    shutil.copy(REPOSITORY / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "tests").mkdir()
    done = kvfuzz("campaign", "--allocator", "zoo:NoCopyOnWrite", "--stop-after", "1", "--workers", "1", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    saved = list((tmp_path / ".kvfuzz" / "corpus").glob("*.json"))
    assert len(saved) == 1
    # The new failure's event points at its timeline.
    shown = [line for line in (done.stdout + done.stderr).splitlines() if "see it as a timeline: kvfuzz show" in line]
    assert len(shown) == 1 and saved[0].name in shown[0], done.stdout + done.stderr
    collect = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    collected = subprocess.run(collect, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert "no tests collected" in collected.stdout, collected.stdout
    shutil.copy(saved[0], tmp_path / "corpus" / saved[0].name)  # the control: in the collected corpus, it is a test
    collected = subprocess.run(collect, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert saved[0].stem in collected.stdout, collected.stdout


# -- bad input ----------------------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--duration", "0"], "--duration: '0': must be more than 0 seconds"),
        (["--duration", "-5"], "--duration: '-5': must be more than 0 seconds"),
        (["--duration", "nan"], "--duration: 'nan': must be more than 0 seconds"),
        (["--workers", "0"], "--workers: must be >= 1, got 0"),
        (["--workers", "100000"], "--workers 100000: more than 4 per core"),
        (["--max-examples", "0"], "--max-examples: must be >= 1, got 0"),
        (["--stop-after", "0"], "--stop-after: must be >= 1, got 0"),
        (["--allocator", "zoo:Nope"], "no zoo variant named 'Nope'"),
        (["--allocator", "zoo:Nothing*"], "the pattern matches no registered or zoo allocator"),
        (["--database", "redis://127.0.0.1:PORT/0"], "cannot reach Redis"),
        (["--database", "redis://127.0.0.1/0"], "expected redis://HOST:PORT/N"),
        (["--database", "http://example.com"], "only redis://HOST:PORT/N URLs, or a directory"),
        (["--corpus", "FILE"], "not a directory"),
        (["--known", "MISSING"], "--known MISSING: not a directory"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, arguments, message
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("")
    arguments = [argument.replace("PORT", str(_free_port())) for argument in arguments]
    status = main(["campaign", "--duration", "1", *arguments])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvfuzz: ") and message in lines[0], captured.err
    assert not (tmp_path / ".kvfuzz").exists()  # refused before any work


# -- the pytest plugin's nightly profile ---------------------------------------------------------------------------

pytest_plugins = ["pytester"]


def test_the_nightly_profile_runs_a_campaign_and_fails_with_its_table(pytester: pytest.Pytester) -> None:
    failed = pytester.runpytest_subprocess(
        "--kvfuzz-allocator=zoo:NoCopyOnWrite",
        "--kvfuzz-profile=nightly",
        "--kvfuzz-duration=6",
        "--kvfuzz-workers=1",
        "--kvfuzz-seed=2",
        "-p",
        "no:cacheprovider",
    )
    failed.assert_outcomes(failed=1)
    output = failed.stdout.str()
    assert "new failures:" in output and "invariant 5 (exclusive writes) in " in output, output
    assert list((pytester.path / "corpus").glob("nocopyonwrite-exclusive-writes-*.json"))
    bad = pytester.runpytest_subprocess("--kvfuzz-allocator=zoo:NoCopyOnWrite", "--kvfuzz-duration=0")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    assert "--kvfuzz-duration=0.0: must be more than 0 seconds" in bad.stderr.str()
