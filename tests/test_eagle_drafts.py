"""An EAGLE head's draft K/V (kvfuzz.scheduler.eagle) without vLLM: a hit on the request's own continuation passes,
one on another continuation's draft K/V, or on positions no step wrote, is caught naming the position, slot and
writer; and the configurations the EAGLE drafters are not driven with are refused in one line."""

from __future__ import annotations

import pytest

from kvfuzz.reference.content import TagMemo, prefix_tags
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.eagle import Admitted, DraftKV
from kvfuzz.scheduler.violations import Check, SchedulerViolation

NAMESPACE = ("group", "0")
SLOTS = [8, 9, 10, 11]  # block 2 of 4 slots


def cached(tokens: list[int]) -> DraftKV:
    """r0, whose tokens are ``tokens``, computed positions 0..3 into block 2 at step 1."""
    drafts = DraftKV(TagMemo(), {})
    drafts.write("r0", tokens, range(4), SLOTS, NAMESPACE, 1)
    return drafts


def test_a_written_position_holds_the_tag_of_the_prefix_up_to_the_next_token() -> None:
    drafts = cached([0, 1, 2, 0, 3])
    assert drafts.slots[11].next_tag == prefix_tags(NAMESPACE, [0, 1, 2, 0, 3])[4]
    assert drafts.slots[8].position == 0 and drafts.slots[8].request == "r0"


def test_a_hit_on_the_same_continuation_passes() -> None:
    drafts = cached([0, 1, 2, 0, 3])
    drafts.admit(Admitted("r1", 4, SLOTS, 0, [0, 1, 2, 0, 3, 1], NAMESPACE))
    drafts.check_admitted(2)
    assert drafts.admitted == []


def test_a_hit_on_another_continuations_draft_kv_is_caught() -> None:
    drafts = cached([0, 1, 2, 0, 3])
    drafts.admit(Admitted("r1", 4, SLOTS, 0, [0, 1, 2, 0, 1], NAMESPACE))
    with pytest.raises(SchedulerViolation) as caught:
        drafts.check_admitted(2)
    assert caught.value.check == Check.PREFIX_HIT and caught.value.request == "r1"
    assert caught.value.cause == "a hit on another continuation's draft K/V"
    assert str(caught.value) == (
        "prefix-hit check failed at step 2, request r1: it is scheduled with 4 tokens from the prefix cache, and the "
        "EAGLE head reads its draft K/V at position 3 (slot 11), which must be computed with its next token 1, but "
        "holds the draft K/V request r0 wrote at its position 3 at step 1, for another continuation: the hit should "
        "have stopped before this block (vLLM's lookahead block hashes, or the EAGLE block drop)"
    )


def test_a_hit_on_positions_no_step_wrote_is_caught() -> None:
    drafts = DraftKV(TagMemo(), {})
    drafts.admit(Admitted("r1", 4, SLOTS, 0, [0, 1, 2, 0, 1], NAMESPACE))
    with pytest.raises(SchedulerViolation) as caught:
        drafts.check_admitted(2)
    assert caught.value.cause == "a hit on draft K/V never written"
    assert "at position 0 (slot 8)" in str(caught.value) and "no step wrote draft K/V there" in str(caught.value)


def test_a_request_without_a_hit_is_not_held_for_the_check() -> None:
    drafts = DraftKV(TagMemo(), {})
    drafts.admit(Admitted("r1", 0, [], 0, [0, 1], NAMESPACE))
    assert drafts.admitted == []


@pytest.mark.parametrize(
    ("changes", "line"),
    [
        ({"kv_connector": "pd"}, "drafter eagle is not driven with the P/D connector"),
        ({"model": "sliding-window"}, "drafter eagle is driven on the full-attention model only"),
        ({"model": "chunked-local"}, "would change how vLLM groups a hybrid model's layers"),
        ({"speculative_tokens": 0}, "drafter eagle needs speculative decoding"),
    ],
)
def test_the_configurations_eagle_is_not_driven_with_are_refused(changes: dict[str, object], line: str) -> None:
    settings: dict[str, object] = {"speculative_tokens": 2, "drafter": "eagle", **changes}
    with pytest.raises(ValueError, match=line):
        SchedulerSetup(**settings)  # type: ignore[arg-type]
