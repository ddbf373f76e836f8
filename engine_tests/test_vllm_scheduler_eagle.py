"""An EAGLE drafter's draft K/V under vLLM's prefix cache (kvfuzz.scheduler.eagle): the unmodified scheduler passes
with lookahead block hashes (vLLM's default for EAGLE); each seeded bug that hands a request a block whose last
position's draft K/V was computed for another next token is caught; and the bug kvfuzz found in the trailing-block
drop (``eagle-drop``) replays on the installed vLLM and passes with lookahead hashes.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
from vllm.config import SpeculativeConfig

from engine_tests.vllm_seeded_runs import run_until_finished
from kvfuzz.scheduler import vllm_build
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.replay import replay
from kvfuzz.scheduler.search import search
from kvfuzz.scheduler.session import Session
from kvfuzz.scheduler.trace import load
from kvfuzz.scheduler.violations import Check, SchedulerViolation

EAGLE = SchedulerSetup(num_blocks=12, speculative_tokens=2, drafter="eagle")
DROP = attrs.evolve(EAGLE, drafter="eagle-drop")
STALE = Path(__file__).parent / "data" / "eagle-drop-duplicate-block-stale-draft.json"


def continued_after_a_cached_block(setup: SchedulerSetup) -> None:
    """r0 caches block [0, 1, 2, 0] (with draft K/V for its sampled token), then r1 matches it and goes on with 1."""
    session = Session(setup)
    run_until_finished(session, session.add([0, 1, 2, 0], 1))
    session.step()
    run_until_finished(session, session.add([0, 1, 2, 0, 1, 1], 1))
    session.drain()


@pytest.mark.parametrize(
    "setup",
    [
        EAGLE,
        attrs.evolve(EAGLE, async_scheduling=True),
        attrs.evolve(EAGLE, kv_events=True, kv_events_full=True),
    ],
    ids=["full", "async", "kv-events"],
)
def test_the_unmodified_scheduler_passes_with_lookahead_hashes(setup: SchedulerSetup) -> None:
    outcome = search(setup, examples=30, steps=30)
    assert outcome.failure is None, f"{outcome.failure}\n{outcome.program}"
    assert outcome.hit_tokens > 0, outcome.describe()


def test_the_drop_and_the_lookahead_hashes_each_keep_a_hit_off_another_continuation() -> None:
    continued_after_a_cached_block(EAGLE)
    continued_after_a_cached_block(DROP)


def test_the_offloading_connector_loads_no_trailing_chunk_of_another_continuation() -> None:
    """With a KV connector vLLM keeps the legacy hashes, so the drop: r0's block is in the local prefix cache and in
    the offload store, and r1, going on with another token, gets neither (the offloading connector keeps the EAGLE
    group's trailing chunk out of its hits, as the drop does the local cache's)."""
    session = Session(attrs.evolve(EAGLE, kv_connector="offloading", transfer_delay=1))
    run_until_finished(session, session.add([0, 1, 2, 0, 1, 2], 1))
    for _ in range(2):
        session.step()  # the stores complete
    assert session.connector.tally.stores > 0
    run_until_finished(session, session.add([0, 1, 2, 0, 0], 1))
    assert session.connector.tally.loads == 0 and session.hit_tokens == 0
    session.drain()


def test_lookahead_hashes_that_leave_the_next_token_out_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the request block hasher is built without the lookahead (as an engine core that forgot it would),
    while the scheduler, told of lookahead hashes, drops nothing."""
    namespace = vllm_build.vllm()
    original = namespace.get_request_block_hasher
    monkeypatch.setattr(namespace, "get_request_block_hasher", lambda size, fn, lookahead=0: original(size, fn))
    with pytest.raises(SchedulerViolation) as caught:
        continued_after_a_cached_block(EAGLE)
    assert caught.value.check == Check.PREFIX_HIT
    assert caught.value.cause == "a hit on another continuation's draft K/V"
    assert "reads its draft K/V at position 3" in str(caught.value) and "its next token 1" in str(caught.value)


def test_a_drop_that_is_not_made_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: vLLM's scheduler is told to drop no block (``use_eagle_block_drop`` false) with the lookahead
    hashes off."""

    def no_drop(self: Any) -> bool:
        return False

    monkeypatch.setattr(SpeculativeConfig, "use_eagle_block_drop", no_drop)
    with pytest.raises(SchedulerViolation) as caught:
        continued_after_a_cached_block(DROP)
    assert caught.value.cause == "a hit on another continuation's draft K/V"


def test_the_drop_hands_a_duplicate_blocks_stale_draft_kv_and_lookahead_hashes_do_not() -> None:
    """The bug kvfuzz met in its first runs of ``eagle-drop`` (engine_tests/data: the standalone reproducer plays the
    n-gram drafter only), word for word on the installed vLLM; the same program passes with lookahead hashes."""
    trace = load(STALE)
    assert trace.known_bug and "0.33.0 and 0.34.0" in trace.known_bug
    replayed = replay(trace)
    assert replayed.reproduced and replayed.identical, replayed.describe_failure()
    lookahead = replay(attrs.evolve(trace, setup=attrs.evolve(trace.setup, drafter="eagle")))
    assert not lookahead.reproduced and lookahead.failure is None, lookahead.describe_failure()
