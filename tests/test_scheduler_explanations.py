"""Explanations that agree with themselves (issue 45, item 12): the rollback check names the positions that hold
rejected drafts only where drafts were rejected, never an empty range; a position a KV connector's load gave is
not called a cache hit."""

from __future__ import annotations

import pytest

from kvfuzz.scheduler.kv_slots import SlotPool
from kvfuzz.scheduler.speculative import Speculation, Verified
from kvfuzz.scheduler.violations import SchedulerViolation


def rollback(verified: Verified, computed: int) -> SchedulerViolation:
    speculation = Speculation(2)
    speculation.verified["r0"] = verified
    with pytest.raises(SchedulerViolation) as caught:
        speculation.check_computed("r0", computed, 5)
    return caught.value


def test_all_drafts_accepted_and_more_counted_is_not_called_rejected_drafts() -> None:
    error = rollback(Verified((3,), 1, 4), 5)  # 3 known tokens, 1 draft accepted: positions 0..3 valid
    assert "(1 accepted, 0 rejected)" in str(error) and "rejected drafts' K/V" not in str(error), error
    assert (
        "position 4 lies beyond the drafts" in str(error) and error.cause == "computed tokens counted past the drafts"
    )


def test_rejected_drafts_kept_are_named_as_such() -> None:
    error = rollback(Verified((3, 1), 0, 3), 5)
    assert "positions 3..4 hold rejected drafts' K/V" in str(error) and error.cause == "rejected drafts not rolled back"


def test_a_rollback_past_the_known_tokens_names_known_and_accepted_tokens() -> None:
    error = rollback(Verified((3, 1), 1, 4), 2)
    assert "position 2 holds known tokens' K/V and position 3 holds accepted drafts' K/V" in str(error), error
    assert error.cause == "valid K/V rolled back"


def test_drafts_where_no_position_is_scheduled_say_so_without_an_empty_range() -> None:
    speculation = Speculation(2)
    speculation.scheduled["r0"] = [1]
    with pytest.raises(SchedulerViolation) as caught:
        speculation.verify("r0", 2, 2, 5)
    assert "2..1" not in str(caught.value) and "no position beyond them is scheduled" in str(caught.value)


def test_a_position_a_failed_connector_load_left_unfilled_is_not_a_cache_hit() -> None:
    pool = SlotPool(8, 2)
    pool.loaded.update({2: False, 3: False})  # a load targeted block 1 and failed before it
    with pytest.raises(SchedulerViolation) as caught:
        pool.check("r0", [1, 2], [2, 3], 4, hit=2)
    assert caught.value.cause == "a block a failed connector load never filled"
    pool.loaded.update({2: True, 3: True})
    with pytest.raises(SchedulerViolation) as caught:
        pool.check("r0", [1, 2], [2, 3], 4, hit=2)
    assert caught.value.cause == "a connector load of other content"
    pool.loaded.clear()
    with pytest.raises(SchedulerViolation) as caught:
        pool.check("r0", [1, 2], [2, 3], 4, hit=2)
    assert caught.value.cause == "a cache hit on unwritten content"
