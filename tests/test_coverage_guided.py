"""Coverage as a scheduler campaign's signal (kvfuzz.campaign.scheduler.guided, seeds, bandit, scheduler.mutate) on
a toy engine written here: its code is the code under test, measured; a fake target runs programs on it, in
Hypothesis-like batches (through the journal, as the real search does) and as programs (as a trace replay does)."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping, Optional

import attrs
import pytest
from factories import swarm_as_seeded

from kvfuzz.campaign.bandit import FRESH, MUTANTS, Bandit
from kvfuzz.campaign.feedback import Feedback, FeedbackJournal
from kvfuzz.campaign.scheduler.guided import Guidance
from kvfuzz.campaign.scheduler.loop import SchedulerCampaignOptions
from kvfuzz.campaign.scheduler.target import SchedulerTarget
from kvfuzz.campaign.seeds import Seed, SeedPool
from kvfuzz.coverage.scope import Scope
from kvfuzz.program.safeguards import Journal
from kvfuzz.scheduler import swarm
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.machine import Witness
from kvfuzz.scheduler.mutate import MUTATIONS, mutate, repair
from kvfuzz.scheduler.program import Abort, AddRequest, Operation, ResetPrefixCache, Step
from kvfuzz.scheduler.replay import SchedulerReplay
from kvfuzz.scheduler.search import Outcome
from kvfuzz.scheduler.swarm import NothingValid, SwarmConfig
from kvfuzz.scheduler.trace import (
    RecordedFailure,
    SchedulerTrace,
    SchedulerTraceError,
    from_json,
    journal_configuration,
)

ENGINE = """\
def add(state, prompt, max_tokens):
    state["waiting"].append((len(prompt), max_tokens))
    if len(prompt) > 8:
        state["long"] += 1
    return "r%d" % (len(state["waiting"]) - 1)


def step(state):
    if not state["waiting"]:
        return 0
    length, tokens = state["waiting"].pop(0)
    if tokens > 4:
        state["waiting"].append((length, tokens - 4))
        if state["long"] > 2:
            state["preempted"] += 1
    return length
"""
"""The toy engine: a queue of requests, a step that serves the first, a branch only long prompts reach."""

LATER_ROWS = (
    "load_failures",
    "drafter",
    "kv_events_full",
    "long_prefill_token_threshold",
    "long_prefill_token_threshold_adaptive",
    "max_num_active_seqs",
    "prefill_schedule_interval",
    "pauses",
)
"""Swarm rows added after these tests' seeds were chosen: held at their first value, drawing nothing."""


@pytest.fixture
def engine(tmp_path: Path) -> ModuleType:
    path = tmp_path / "kvfuzz_toy_engine.py"
    path.write_text(ENGINE)
    spec = importlib.util.spec_from_file_location("kvfuzz_toy_engine", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvfuzz_toy_engine"] = module  # imported: the campaign reports it
    spec.loader.exec_module(module)
    yield module
    del sys.modules["kvfuzz_toy_engine"]


class ToySession:
    """The client's side of the toy engine (kvfuzz's code: not measured)."""

    def __init__(self, engine: ModuleType) -> None:
        self.engine = engine
        self.state: dict[str, Any] = {"waiting": [], "long": 0, "preempted": 0}

    def add(self, prompt: list[int], max_tokens: int, *rest: Any) -> str:
        return str(self.engine.add(self.state, prompt, max_tokens))

    def abort(self, request: str) -> None:
        pass

    def step(self) -> int:
        return int(self.engine.step(self.state))

    def reset_prefix_cache(self, preempt: bool = False) -> bool:
        return True


@attrs.define
class ToyTarget:
    """Searches draw random programs (journaled as the real search journals them); replays run a trace's program."""

    engine: ModuleType

    def target(self) -> SchedulerTarget:
        scope = Scope((str(Path(self.engine.__file__).resolve()),))
        # rows added after these tests' seeds were chosen are held without drawing, so each seed draws as before
        held = swarm_as_seeded(LATER_ROWS)
        return SchedulerTarget("vllm-v1", self.validate, self.search, self.replay, scope=lambda: scope, dimensions=held)

    def validate(self, setup: SchedulerSetup, runner: str) -> None:
        if setup.max_num_batched_tokens < setup.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be greater than or equal to max_num_seqs")

    def search(
        self,
        config: SwarmConfig,
        examples: int,
        seed: int,
        shrink: bool,
        witness: Optional[Witness],
        call_timeout: Optional[float],
        journal: Optional[Journal],
    ) -> Outcome:
        rng = random.Random(seed)
        steps = 0
        for _ in range(examples):
            session = ToySession(self.engine)
            if journal is not None:
                journal.begin_example(journal_configuration(config.setup, config.model_runner))
            for _ in range(rng.randint(1, 4)):
                add = AddRequest([1] * rng.randint(1, 4), rng.randint(1, 3))
                operation: Operation = add if rng.random() < 0.6 else Step()
                if journal is not None:
                    journal.call(operation.to_json())
                operation.apply(session)
                steps += isinstance(operation, Step)
        return Outcome(config.setup, examples, steps, 0, 0, 0.01, None, "")

    def replay(self, trace: SchedulerTrace, call_timeout: Optional[float]) -> SchedulerReplay:
        session = ToySession(self.engine)
        for operation in trace.program:
            operation.apply(session)
        return SchedulerReplay(trace, None, None)


SETUP = SchedulerSetup(num_blocks=16, block_size=4, max_num_batched_tokens=64, max_num_seqs=4, prefix_caching=True)
CONFIG = SwarmConfig(SETUP, "V2", 20, 0)


def _guidance(engine: ModuleType, tmp_path: Path, guided: bool = True) -> Guidance:
    target = ToyTarget(engine).target()
    options = SchedulerCampaignOptions("vllm-v1", 1, tmp_path / "corpus", coverage=True, guided=guided)
    assert target.scope is not None
    return Guidance(target, options, target.scope(), tmp_path / "state", 0)


def _journal(guide: Guidance, tmp_path: Path) -> FeedbackJournal:
    """The journal a campaign's worker writes, telling ``guide``'s feedback each example's start and calls."""
    return FeedbackJournal(tmp_path / "journals", {"scheduler": "vllm-v1"}, {}, guide.feedback)


def _example(journal: FeedbackJournal, engine: ModuleType, program: list[Operation]) -> None:
    journal.begin_example(journal_configuration(SETUP, "V2"))
    session = ToySession(engine)
    for operation in program:
        journal.call(operation.to_json())
        operation.apply(session)


def _seed_programs(directory: Path) -> list[str]:
    return sorted(json.dumps(json.loads(path.read_text())["program"]) for path in directory.glob("*.json"))


def test_a_program_reaching_new_coverage_is_kept_and_one_that_does_not_is_not(
    engine: ModuleType, tmp_path: Path
) -> None:
    guide = _guidance(engine, tmp_path)
    journal = _journal(guide, tmp_path)
    guide.feedback.begin(CONFIG, CONFIG.to_json())
    first = [AddRequest([1, 2], 1), Step()]
    _example(journal, engine, first)
    _example(journal, engine, [AddRequest([3, 4], 1), Step()])  # the same lines and branches: not kept
    longer = [AddRequest([1] * 9, 6), Step()]  # a long prompt, a request served in two steps: new branches
    _example(journal, engine, longer)
    covered = guide.feedback.end()
    seeds = tmp_path / "state" / "seeds"
    assert _seed_programs(seeds) == sorted(json.dumps([op.to_json() for op in kept]) for kept in (first, longer))
    kept = [json.loads(path.read_text()) for path in seeds.glob("*.json")]
    assert all(seed["config"] == CONFIG.to_json() for seed in kept), "each seed is kept with its configuration"
    engine_file = str(Path(engine.__file__).resolve())
    assert covered.files == (engine_file,)
    reached = covered.points[engine_file]
    assert [3, 4] in reached["branches"] and [12, 13] in reached["branches"]  # len(prompt) > 8; tokens > 4
    assert guide.feedback.entry()["new_lines"] == len(reached["lines"]) > 0


def test_without_guided_coverage_is_measured_but_nothing_is_kept(engine: ModuleType, tmp_path: Path) -> None:
    guide = _guidance(engine, tmp_path, guided=False)
    journal = _journal(guide, tmp_path)
    guide.feedback.begin(CONFIG, CONFIG.to_json())
    _example(journal, engine, [AddRequest([1, 2], 1), Step()])
    assert guide.feedback.end().points and not (tmp_path / "state" / "seeds").exists()


def test_a_refused_configuration_is_refused_again_without_asking_the_engine(engine: ModuleType, tmp_path: Path) -> None:
    guide = _guidance(engine, tmp_path)
    asked: list[SchedulerSetup] = []

    def validate(setup: SchedulerSetup, runner: str) -> None:
        asked.append(setup)
        raise ValueError("refused")

    guide.target = attrs.evolve(guide.target, validate=validate)
    for _ in range(3):
        with pytest.raises(ValueError, match="refused"):
            guide.validate(SETUP, "V2")
    assert asked == [SETUP]


def test_fresh_draws_take_each_model_connector_and_prefix_unit_in_turn_whatever_its_weight(
    engine: ModuleType, tmp_path: Path
) -> None:
    """The swarm draws each hybrid model one time in five, the P/D connector (full attention only) about one in
    eight and a prefix hash unit below the block one in 20 (on the Mamba hybrid only); a guided campaign's fresh
    draws hold one stratified row's least-drawn value at a time, so every model, every connector and every unit gets
    its turns; a pinned row stays pinned, and a value nothing valid takes is counted as tried and followed by a plain
    draw."""
    guide = _guidance(engine, tmp_path)
    asked: list[dict[str, Any]] = []

    def fresh(held: Mapping[str, Any]) -> SwarmConfig:
        asked.append(dict(held))
        if held.get("model") == "sliding-window":
            raise NothingValid("refused")
        unit = held.get("prefix_match_unit", 0)
        model = "mamba-hybrid" if unit else held.get("model", "full")
        setup = attrs.evolve(
            SETUP, model=model, kv_connector=held.get("kv_connector", "none"), prefix_match_unit=unit, block_size=4
        )
        return attrs.evolve(CONFIG, setup=setup)

    rng = random.Random(3)
    drawn = [guide.plan(rng, number, 25, None, None, fresh)[0].config.setup for number in range(14)]
    assert all(len(held) <= 1 for held in asked), asked
    models, connectors = {setup.model for setup in drawn}, {setup.kv_connector for setup in drawn}
    assert models == {"full", "mamba-hybrid", "chunked-local"} and connectors == {"none", "offloading", "pd"}, drawn
    assert {setup.prefix_match_unit for setup in drawn} == {0, 1, 2}, drawn
    assert asked.count({"model": "sliding-window"}) == asked.count({}) >= 1, asked
    pinned = _guidance(engine, tmp_path / "pinned")
    pinned.options = attrs.evolve(pinned.options, pins=(("model", "full"),))
    asked.clear()
    for number in range(6):
        pinned.plan(rng, number, 25, None, None, fresh)
    assert asked and all("model" not in held for held in asked), "a row the campaign pins is not stratified"


def test_the_bandit_gives_batches_to_configurations_still_finding_coverage() -> None:
    bandit = Bandit(explore=0.0)
    assert bandit.choose(random.Random(0)) is None, "no arm yet: a fresh configuration"
    bandit.record("finds", 40, 10.0)
    bandit.record("stale", 0, 10.0)
    rng = random.Random(1)
    assert {bandit.choose(rng) for _ in range(50)} == {"finds"}
    for _ in range(10):  # stops finding: fades, and fresh configurations are drawn again
        bandit.record("finds", 0, 10.0)
    assert bandit.choose(rng) is None


def test_the_bandit_scores_new_coverage_per_second_not_per_batch() -> None:
    bandit = Bandit(explore=0.0)
    bandit.record("slow", 60, 300.0)  # more points a batch, in a batch that held the campaign five minutes
    bandit.record("quick", 20, 5.0)
    rng = random.Random(3)
    quick = sum(bandit.choose(rng) == "quick" for _ in range(200))
    assert quick > 180, f"the quick configuration got {quick} of 200 batches"


def test_fresh_configurations_are_drawn_while_they_pay_more_than_the_arms() -> None:
    bandit = Bandit(explore=0.0)
    bandit.record("finds a little", 2, 10.0)
    bandit.record(FRESH, 60, 10.0)  # freshly drawn configurations found far more
    rng = random.Random(2)
    fresh = sum(bandit.choose(rng) is None for _ in range(200))
    assert fresh > 150, f"{fresh} of 200 batches drew a fresh configuration"
    for _ in range(10):  # fresh draws stop paying: the arm still finding gets the batches
        bandit.record(FRESH, 0, 10.0)
        bandit.record("finds a little", 2, 10.0)
    assert sum(bandit.choose(rng) is None for _ in range(200)) < 20


def test_the_seed_pool_is_shared_through_its_directory(tmp_path: Path) -> None:
    one, other = SeedPool(tmp_path, "vllm-v1"), SeedPool(tmp_path, "vllm-v1")
    seed = Seed.of("vllm-v1", CONFIG.to_json(), [{"op": "step"}], 3)
    one.add(seed)
    assert other.refresh() == 1 and other.seeds[seed.digest].program == ({"op": "step"},)
    assert SeedPool(tmp_path, "sglang").refresh() == 0, "another target's seeds are not drawn"


# -- the mutator ----------------------------------------------------------------------------------------------


def _setups() -> list[SchedulerSetup]:
    rng = random.Random(5)
    drawn = [swarm.draw(rng, lambda setup, runner: None).setup for _ in range(40)]
    return [SETUP, attrs.evolve(SETUP, policy="priority", prefix_resets=True), *drawn]


def _program(setup: SchedulerSetup, rng: random.Random) -> tuple[Operation, ...]:
    operations: list[Operation] = []
    for _ in range(rng.randint(0, 12)):
        operations.append(rng.choice([Step(), AddRequest([rng.randrange(50) for _ in range(5)], 3)]))
        if rng.random() < 0.2 and operations:
            operations.append(Abort(f"r{rng.randrange(9)}"))
    return repair(operations, setup)


def _valid(setup: SchedulerSetup, program: tuple[Operation, ...]) -> None:
    """Raises SchedulerTraceError unless a trace of ``program`` reads back (the trace format's own checks)."""
    trace = SchedulerTrace("vllm-v1", setup, "V2", "0.33.0", program, RecordedFailure("crash", "x", "E"), False)
    assert from_json(trace.to_json()).program == program


def test_every_mutant_is_a_valid_program_of_its_configuration() -> None:
    rng = random.Random(11)
    changed = 0
    for setup in _setups():
        for _ in range(25):
            parent, other = _program(setup, rng), _program(setup, rng)
            _valid(setup, parent)
            child = mutate(parent, setup, rng, other)
            _valid(setup, child)
            changed += child != parent
    assert changed > 0.8 * 25 * len(_setups())


def test_each_mutation_yields_a_valid_program_after_repair() -> None:
    rng = random.Random(3)
    for mutation in MUTATIONS:
        for setup in _setups()[:10]:
            for _ in range(10):
                parent, other = _program(setup, rng), _program(setup, rng)
                _valid(setup, repair(mutation(list(parent), setup, rng, other), setup))


def test_a_splice_renumbers_the_tails_aborts() -> None:
    from kvfuzz.scheduler import mutate as module

    head = [AddRequest([1], 1)]
    other = (AddRequest([2], 1), AddRequest([3], 1), Abort("r1"))

    class Fixed(random.Random):
        def randint(self, a: int, b: int) -> int:
            return {(0, 1): 1, (0, 2): 1}[(a, b)]  # the whole head; the other's tail from its second operation

    spliced = module._splice(head, SETUP, Fixed(), other)
    assert spliced == [AddRequest([1], 1), AddRequest([3], 1), Abort("r1")]  # r1 is the tail's request here too


def test_repair_drops_what_the_configuration_does_not_take() -> None:
    program = [Abort("r0"), AddRequest([1] * 500, 10_000, priority=3), ResetPrefixCache(True), Abort("r0")]
    repaired = repair(program, SETUP)
    assert repaired == (AddRequest([1] * (SETUP.max_model_len - 1), 1), Abort("r0"))
    with pytest.raises(SchedulerTraceError):
        _valid(SETUP, (Abort("r0"),))  # the check the mutator's invariant is tested against can fail


# -- the campaign ---------------------------------------------------------------------------------------------


def _cli(engine: ModuleType, tmp_path: Path, *extra: str) -> dict[str, Any]:
    from kvfuzz.cli import _parser
    from kvfuzz.commands.scheduler_campaign import scheduler_campaign

    argv = ["campaign", "--scheduler", "vllm-v1", "--seed", "2", "--max-examples", "300", "--batch-examples", "10"]
    argv += ["--corpus", str(tmp_path / "corpus"), "--no-known", "--json", *extra]
    emitted: list[Any] = []
    status = scheduler_campaign(_parser().parse_args(argv), emitted.append, ToyTarget(engine).target())
    assert status == 0
    return dict(emitted[0])


def test_the_campaigns_json_reports_coverage_and_guided_batches_mutate_seeds(
    engine: ModuleType, tmp_path: Path
) -> None:
    result = _cli(engine, tmp_path, "--guided", "--coverage-html", str(tmp_path / "html"))
    coverage = result["coverage"]
    (row,) = coverage["files"]
    assert row["path"] == str(Path(engine.__file__).resolve())
    assert (row["lines"], row["branches"]) == (14, 8)  # the toy engine's two functions, counted by hand
    assert 0 < coverage["lines_reached"] <= 14 and coverage["timeline"]
    assert coverage["timeline"][-1]["lines"] == coverage["lines_reached"]
    log = result["batch_log"]
    assert all("new_lines" in batch and "new_branches" in batch for batch in log)
    assert any(batch["mutated_seed"] for batch in log), "batches mutate kept programs"
    assert list((tmp_path / "corpus" / ".kvfuzz-campaign" / "seeds").glob("vllm-v1-*.json"))
    assert "--guided" in result["rerun_command"]
    assert "kvfuzz_toy_engine.py" in (tmp_path / "html" / "index.html").read_text()


def test_a_blind_campaign_with_coverage_reports_it_and_mutates_nothing(engine: ModuleType, tmp_path: Path) -> None:
    result = _cli(engine, tmp_path, "--coverage")
    assert result["coverage"]["lines_reached"] > 0
    assert all("mutated_seed" not in batch for batch in result["batch_log"])
    assert not (tmp_path / "corpus" / ".kvfuzz-campaign" / "seeds").exists()


def test_without_coverage_the_json_says_none(engine: ModuleType, tmp_path: Path) -> None:
    assert _cli(engine, tmp_path)["coverage"] is None


def test_mutants_get_half_the_batches_until_they_run_then_the_share_they_earn() -> None:
    bandit = Bandit()
    assert bandit.share(MUTANTS, 0.1, 0.5) == 0.5, "not run yet: their worth unknown"
    bandit.record(MUTANTS, 30, 10.0)
    bandit.record(FRESH, 10, 10.0)
    assert bandit.share(MUTANTS, 0.1, 0.5) == 0.5, "three quarters of what is found, capped at half"
    for _ in range(10):  # mutants stop finding while fresh draws still do
        bandit.record(MUTANTS, 0, 10.0)
        bandit.record(FRESH, 10, 10.0)
    assert bandit.share(MUTANTS, 0.1, 0.5) == 0.1
    for _ in range(40):  # nothing finds any more: the least share, the rest blind
        bandit.record(FRESH, 0, 10.0)
    assert bandit.share(MUTANTS, 0.1, 0.5) == 0.1
    rng = random.Random(4)
    bandit.record("{}", 40, 10.0)
    assert {bandit.choose(rng) for _ in range(50)} <= {None, "{}"}, "the mutants' arm is no configuration"


def test_a_configuration_whose_batch_reaches_nothing_new_is_retired_at_once() -> None:
    """Before: its score halved a batch, so a configuration that found 300 points in its first batch was run again
    for ten batches after it had stopped finding anything, while fresh draws waited."""
    bandit = Bandit(explore=0.0)
    bandit.record("first", 300, 1.0)
    bandit.record(FRESH, 10, 1.0)
    assert bandit.choose(random.Random(0)) == "first" or bandit.choose(random.Random(1)) == "first"
    bandit.record("first", 0, 1.0)
    assert "first" not in bandit.scores and {bandit.choose(random.Random(seed)) for seed in range(20)} == {None}
    bandit.record("first", 5, 1.0)  # a later batch of it (mutants, say) found something: back
    assert "first" in bandit.scores
    bandit.record(FRESH, 0, 1.0)
    assert FRESH in bandit.scores, "the fresh arm decays; it is never retired"


def test_a_guided_worker_keeps_only_the_configurations_its_bandit_still_scores(tmp_path: Path) -> None:
    """A long campaign draws thousands of configurations: one whose batch found nothing is retired by the bandit, and
    the feedback forgets it too; an unguided worker keeps none."""
    guided = Feedback(Scope(()), 0, SeedPool(tmp_path, "vllm-v1"))
    guided.begin(CONFIG, CONFIG.to_json(), drawn_fresh=True)
    guided.end()  # no code under test: nothing found
    assert guided.arms == {} and guided.arm(random.Random(0)) is None
    blind: Feedback[SwarmConfig] = Feedback(Scope(()), 0)
    blind.begin(CONFIG, CONFIG.to_json())
    blind.end()
    assert blind.arms == {} and blind.bandit.scores == {}
