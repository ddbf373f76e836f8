"""The engine driven by hand: what the engine model does, and what its explanations tell a person."""

from __future__ import annotations

import pytest
from factories import make_allocator

from kvfuzz.engine import Engine, Invariant, InvariantViolation, MachineConfig, MisuseCall
from kvfuzz.engine.checks.window import InflightWindow
from kvfuzz.engine.misuse import misuse_calls
from kvfuzz.zoo import variant

CONFIG = MachineConfig(block_size=4, num_blocks=8, num_host_blocks=4)


def engine(factory) -> Engine:
    return Engine(factory(CONFIG.pool_spec()), CONFIG)


def test_a_clean_life_cycle_passes_every_check() -> None:
    h = engine(make_allocator(window=1))
    assert h.admit("s0", (), (1, 2, 3, 4, 5))
    h.step()
    assert h.fork("s0", "s1")
    assert h.grow("s0", (6,)) and h.grow("s1", (7,))
    h.step()
    h.step()
    assert h.admit("s2", (), (1, 2, 3, 4, 9))
    assert h.stats["cache-hit tokens"] == 4
    assert h.stats["copy-on-write copies"] == 1
    h.rollback("s0", 2)
    assert h.swap_out("s1") and h.swap_in("s1")
    h.preempt("s2")
    assert h.readmit("s2")
    h.step()
    h.quiesce()


def test_window_violation_names_the_release_and_the_new_owner() -> None:
    h = engine(variant("ImmediateReuse").factory())
    h.admit("s0", (), (1,) * 32)
    h.step()
    h.free("s0")
    with pytest.raises(InvariantViolation) as caught:
        h.admit("s1", (), (2,))
    error = caught.value
    assert error.invariant is Invariant.NON_REUSE_WINDOW
    text = error.explain()
    assert "released by s0" in text and "handed to s1" in text and "W = 1" in text
    assert "released (free) by s0" in text and "admitted as s1 as logical block 0" in text


def test_premature_reuse_corrupts_data_observably(monkeypatch) -> None:
    """With the window check switched off, the late in-flight work of the freed sequence lands on the new owner's
    block when its step completes, and the content check traces the corruption to it."""
    monkeypatch.setattr(InflightWindow, "outside", lambda self, blocks, seq: None)
    h = engine(variant("ImmediateReuse").factory())
    h.admit("s0", (), (1,) * 32)
    h.step()
    h.free("s0")
    h.admit("s1", (), (2, 2, 2))
    with pytest.raises(InvariantViolation) as caught:
        h.step()
        h.step()
    error = caught.value
    assert error.invariant is Invariant.CONTENT
    text = error.explain()
    assert "sequence s1 position 0" in text and "sequence s0" in text and "late in-flight work" in text


def test_missing_copy_on_write_is_an_exclusive_write_with_both_holders_named() -> None:
    h = engine(variant("NoCopyOnWrite").factory())
    h.admit("s0", (), (1, 2))
    h.step()
    h.fork("s0", "s1")
    with pytest.raises(InvariantViolation) as caught:
        h.grow("s1", (3,))
    assert caught.value.invariant is Invariant.EXCLUSIVE_WRITES
    assert "grow schedules writes of s1's logical block 0" in caught.value.explain()
    assert "('s0', 0)" in caught.value.explain() and "('s1', 0)" in caught.value.explain()


def test_wrong_copy_source_is_traced_to_the_block_it_came_from() -> None:
    h = engine(variant("CopiesWrongBlock").factory())
    h.admit("s0", (), (1, 2, 3, 4, 5, 6))
    h.step()
    h.fork("s0", "s1")
    with pytest.raises(InvariantViolation) as caught:
        h.grow("s1", (7,))
    text = caught.value.explain()
    assert caught.value.invariant is Invariant.CONTENT
    assert "expected: K/V of namespace (), tokens [1, 2, 3, 4, 5]" in text
    assert "copied from block" in text and "history" in text


def test_false_refusal_reports_what_was_available() -> None:
    h = engine(variant("FalseOutOfBlocks").factory())
    h.admit("s0", (), tuple(range(4)) * 8)
    for _ in range(3):
        h.step()
    h.free("s0")
    h.step()
    assert len(h.allocator.cached_blocks()) == 8
    with pytest.raises(InvariantViolation) as caught:
        h.admit("s1", (9,), (1,) * 32)
    assert caught.value.invariant is Invariant.NO_FALSE_REFUSAL
    assert "available: 8" in caught.value.explain()


def test_misuse_must_raise_a_typed_error() -> None:
    h = engine(variant("SilentDoubleFree").factory())
    h.admit("s0", (), (1,))
    h.free("s0")
    with pytest.raises(InvariantViolation) as caught:
        h.misuse(MisuseCall("free", ("s0",), "s0 was already freed"))
    assert caught.value.invariant is Invariant.MISUSE
    assert "accepted silently" in caught.value.explain()


def test_correct_allocator_refuses_every_misuse_cleanly() -> None:
    h = engine(make_allocator(window=1))
    h.admit("s0", (), (1, 2, 3))
    h.step()
    h.admit("s1", (), (4,))
    h.free("s1")
    h.preempt("s0")
    h.readmit("s0")
    h.step()
    h.admit("s2", (), (5,))
    h.preempt("s2")
    calls = misuse_calls(h.expected)
    assert {call.op for call in calls} >= {"free", "grow", "admit", "rollback", "fork", "swap_in"}
    for call in calls:
        h.misuse(call)
    assert h.stats["misuse"] == len(calls)  # each call above was refused cleanly, or misuse() would have raised


def test_leak_without_introspection_is_caught_by_the_quiescence_probe() -> None:
    h = engine(variant("OpaqueLeakOnCancel").factory())
    h.admit("s0", (), (1, 2, 3, 4, 5))
    h.free("s0")
    with pytest.raises(InvariantViolation) as caught:
        h.quiesce()
    assert caught.value.invariant is Invariant.QUIESCENCE


def test_a_feature_is_built_and_subscribed_only_when_the_allocator_declares_it() -> None:
    """An allocator that declares no optional capability gets no feature, and its events run the core's own
    subscribers alone (refcounts and the free set); declaring complete caching builds that feature and subscribes it
    to the events it needs, and nothing else."""
    bare = engine(make_allocator(prefix_caching=False, introspection=False))
    features = ("groups", "window_drops", "host_tier", "async_loading", "lookahead", "caching_debt", "tail_dedup")
    assert all(getattr(bare, name) is None for name in (*features, "remaps"))
    events = bare.events
    assert not (events.table_set or events.releasing or events.scheduling or events.launching or events.completing)
    assert len(events.table_changed) == 1 and len(events.completed) == 1  # the accounting checks
    assert len(events.launched) == 2 and len(events.quiesced) == 1  # content and attention; quiescence
    caching = engine(make_allocator())
    assert caching.caching_debt is not None
    assert caching.events.table_set == [caching.caching_debt.table_set]
    assert caching.events.scheduling == [caching.caching_debt.scheduling]
    assert caching.events.completed[0] == caching.caching_debt.completed and len(caching.events.completed) == 2
    assert all(getattr(caching, name) is None for name in features if name != "caching_debt")
