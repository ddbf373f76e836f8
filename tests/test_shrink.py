"""Failure signatures (what makes two failures one finding) and shrinking a failing program to a fixpoint
(kvfuzz/shrink/): each pass against a model of replays, and whole shrinks against real allocators."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path
from typing import Any, Sequence

import attrs
import pytest

from kvfuzz.allocator import PagedAllocator, PoolSpec
from kvfuzz.allocator.paged import paged_allocator
from kvfuzz.campaign.swarm import Limits, draw_swarm, probe_limits
from kvfuzz.engine.arguments import system_prompts
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.misuse import MisuseCall
from kvfuzz.engine.violations import InvariantViolation
from kvfuzz.program.call import Call
from kvfuzz.program.execution import Safeguards, Target
from kvfuzz.program.operations import BY_NAME, OPERATIONS
from kvfuzz.program.random_programs import random_program, random_search
from kvfuzz.program.replay import NotApplicable, replay
from kvfuzz.program.safeguards import AllocatorHang, Watchdog
from kvfuzz.program.stats import RunStats
from kvfuzz.registry import load_factory
from kvfuzz.saved.trace import load
from kvfuzz.shrink import candidates, configuration, deletions, fixpoint
from kvfuzz.shrink import restarts as restarting
from kvfuzz.shrink.candidates import Pools
from kvfuzz.shrink.fixpoint import shrink
from kvfuzz.shrink.signature import Signature, signature_of
from kvfuzz.shrink.simplify import _smaller, renumbered
from kvfuzz.zoo import variant as zoo_variant
from tests.hostile import hangs_on_rollback


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
    signature = signature_of("zoo:LeakOnCancel", outcome.failure, calls, outcome.failed_at)
    # The free-set check names the leak's cause, which makes the finding whichever operation met it.
    assert signature.operation is None
    assert signature.cause == "an unreferenced block in none, or several, of the free, cached and pending sets"


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


def test_a_violation_while_the_teardown_frees_a_sequence_is_one_of_free() -> None:
    # Its explanation names the teardown's free; its signature is free's, as if the program had freed the sequence.
    factory = load_factory("zoo:FreeForgetsSharedRefcount")
    admit = Call("admit", {"seq": "s0", "namespace": (), "system": (), "suffix": [1, 2, 3]})
    calls = [admit, Call("step", {}), Call("fork", {"child": "s1", "parent": "s0"})]
    outcome = replay(Target(factory), calls)
    assert isinstance(outcome.failure, InvariantViolation) and outcome.failed_at == len(calls)
    assert outcome.failure.operation == "the teardown's free('s0')"
    at_teardown = signature_of("x", outcome.failure, calls, outcome.failed_at)
    freed = [*calls, Call("free", {"seq": "s0"})]
    explicit = replay(Target(factory), freed)
    assert explicit.failure is not None and explicit.failed_at == len(calls)
    assert signature_of("x", explicit.failure, freed, explicit.failed_at) == at_teardown
    assert at_teardown.cause is not None and at_teardown.cause.startswith("a refcount above")


def test_a_quiescence_failure_is_one_of_the_teardown_keyed_by_its_cause() -> None:
    # Without introspection the leak shows only at the end, when the whole pool cannot be admitted: raised by the
    # teardown (after the last call), and keyed by its cause, not by the free that leaked nor by the teardown.
    factory = load_factory("zoo:OpaqueLeakOnCancel")
    calls = [Call("admit", {"seq": "s0", "namespace": (), "system": (), "suffix": [1]}), Call("free", {"seq": "s0"})]
    outcome = replay(Target(factory), calls)
    assert outcome.failure is not None and outcome.failed_at == len(calls)
    signature = signature_of("zoo:OpaqueLeakOnCancel", outcome.failure, calls, outcome.failed_at)
    assert signature.operation is None and signature.failure == "invariant 10 (quiescence)"
    assert signature.cause is not None and signature.cause.startswith("blocks leaked")


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


@pytest.mark.slow
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
    # A program a campaign found against zoo:EvictsOnRefusal (block size 1, 4 blocks, W = 1). Its signature is keyed
    # by its cause (a refusal that changed the pool), and the passes alone take it to 4 calls: a short fixpoint.
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


@pytest.mark.slow
def test_a_short_fixpoint_is_not_shrunk_again() -> None:
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
    assert len(alone.calls) <= restarting.LONG_PROGRAM  # 4 calls: the passes' fixpoint
    swarm = ("admit", "step", "readmit", "grow", "preempt", "fork", "swap_out")
    restarts = restarting.Restarts(tuple(BY_NAME[name] for name in swarm), 109, random.Random(0))
    again = shrink(factory, config, EVICTS_ON_REFUSAL_FOUND, outcome.failure, signature, restarts=restarts, **bounds)  # type: ignore[arg-type]
    assert again.stopped_early is None and again.restarts == 0 and again.calls == alone.calls


HYBRID_HIT_FOUND = [
    # The first failing program of random_search(seed=2, examples=300, steps=100) against zoo:HybridHitFromFullGroup
    # in the default configuration: a cache hit covering a block an eviction dropped. The passes alone take it to a
    # fixpoint of 13 calls: no call goes alone, and the pool cannot be smaller.
    Call("step", {}),
    Call("admit", {"seq": "s0", "namespace": ("a", "bc"), "system": (0, 3, 2, 1), "suffix": [3, 0, 1, 2]}),
    Call("preempt", {"seq": "s0"}),
    Call("admit", {"seq": "s1", "namespace": (), "system": (0, 3, 2, 1), "suffix": [2, 0]}),
    Call("evict_blocks", {"blocks": [3]}),
    Call("grow", {"seq": "s1", "tokens": [1, 2, 2, 1, 3]}),
    Call("step", {}),
    Call("readmit", {"seq": "s0"}),
    Call("fork", {"parent": "s1", "child": "s2"}),
    Call("grow", {"seq": "s1", "tokens": [2]}),
    Call("preempt", {"seq": "s0"}),
    Call("grow", {"seq": "s1", "tokens": [0]}),
    Call("readmit", {"seq": "s0"}),
    Call("step", {}),
    Call("fork", {"parent": "s2", "child": "s3"}),
    Call("preempt", {"seq": "s1"}),
    Call("decode", {"token": 0}),
    Call("decode", {"token": 3}),
    Call("grow", {"seq": "s2", "tokens": [3]}),
    Call("misuse", {"call": MisuseCall(op="grow", args=("s3", ()), why="no tokens")}),
    Call("evict_blocks", {"blocks": [6, 1, 0]}),
    Call("evict_blocks", {"blocks": [15, 6, 0]}),
    Call("free", {"seq": "s2"}),
    Call("fork", {"parent": "s3", "child": "s4"}),
    Call("evict", {"num_blocks": 4}),
    Call("admit", {"seq": "s5", "namespace": (), "system": (0, 3, 2, 1, 0, 3, 2, 1), "suffix": [1, 0, 1, 0, 3]}),
    Call("preempt", {"seq": "s4"}),
    Call("misuse", {"call": MisuseCall(op="grow", args=("nobody", (1,)), why="nobody was ever admitted")}),
    Call("preempt", {"seq": "s3"}),
    Call("reset_cache", {}),
    Call("readmit", {"seq": "s1"}),
]


@pytest.mark.slow
def test_a_long_fixpoint_is_shrunk_again_from_other_failing_programs_of_the_swarm() -> None:
    spec = "zoo:HybridHitFromFullGroup"
    factory = load_factory(spec)
    limits = probe_limits(spec, factory, MachineConfig())
    config = MachineConfig()
    outcome = replay(Target(factory, config), HYBRID_HIT_FOUND)
    assert outcome.failure is not None
    signature = signature_of(spec, outcome.failure, HYBRID_HIT_FOUND, outcome.failed_at)
    assert signature.failure == "invariant 9 (cache soundness)"
    assert signature.cause == "a cache hit covering a block an eviction dropped"
    bounds = {"seconds": 120.0, "pools": Pools(limits.min_blocks, limits.block_sizes)}
    alone = shrink(factory, config, HYBRID_HIT_FOUND, outcome.failure, signature, **bounds)  # type: ignore[arg-type]
    assert alone.stopped_early is None and alone.restarts == 0
    assert len(alone.calls) > restarting.LONG_PROGRAM, len(alone.calls)  # 13 calls: the passes' fixpoint
    restarts = restarting.Restarts(OPERATIONS, 100, random.Random(0))
    again = shrink(factory, config, HYBRID_HIT_FOUND, outcome.failure, signature, restarts=restarts, **bounds)  # type: ignore[arg-type]
    assert again.stopped_early is None
    assert again.restarts >= 1 and len(again.calls) < len(alone.calls), (len(alone.calls), len(again.calls))
    rerun = replay(Target(factory, again.config), again.calls)  # the shorter program fails the same way, as saved
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
        assert signature_of(spec, rerun.failure, other.calls, rerun.failed_at, rerun.diverged) == other.signature


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
