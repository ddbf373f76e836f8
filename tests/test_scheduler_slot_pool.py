"""The scheduler target's K/V pool (kvfuzz/scheduler/kv_slots.py) as the worker drives it, fed directly (no engine):
the claims a request registers through its block table are the ones it would register slot by slot, the first
registered wins on a shared block, a pool's contents are the K/V of its shadow's tags, and the prefix tags it
keeps per request are :func:`prefix_tags` whatever the sequence does (grow, shrink, change, change namespace)."""

from __future__ import annotations

import random

import pytest
import torch

from kvfuzz.reference.content import TagMemo, kv_for_tags, prefix_tags
from kvfuzz.scheduler.config import MODEL_SHAPE
from kvfuzz.scheduler.kv_slots import Claim, SlotPool
from kvfuzz.scheduler.violations import Check, SchedulerViolation

SIZE = 4  # slots per block


def test_a_claim_through_a_table_names_the_position_and_tag_the_request_relies_on() -> None:
    pool = SlotPool(32, SIZE)
    tokens = [5, 6, 7, 8, 9, 1]  # positions 0..5: block 3 holds 0..3, block 1 holds 4..5
    claims = pool.claims()
    claims.rely("r0", tokens, [3, 1], 0, ("salt", "a"))
    tags = prefix_tags(("salt", "a"), tokens)
    assert claims.get(3 * SIZE + 2) == Claim("r0", 2, tags[2], "relies on", ("salt", "a"))
    assert claims.get(1 * SIZE + 1) == Claim("r0", 5, tags[5], "relies on", ("salt", "a"))
    assert claims.get(1 * SIZE + 2) is None  # position 6: not computed
    assert claims.get(2 * SIZE) is None  # a block it does not hold


def test_a_claim_from_its_window_start_on_leaves_the_positions_before_it_unclaimed() -> None:
    claims = SlotPool(32, SIZE).claims()
    claims.rely("r0", [1, 2, 3, 4, 5, 6], [3, 1], 5, ())
    assert claims.get(3 * SIZE + 3) is None  # position 3, before the window
    assert claims.get(1 * SIZE) is None  # position 4
    held = claims.get(1 * SIZE + 1)
    assert held is not None and held.position == 5


def test_on_a_shared_block_the_first_request_relying_on_the_slot_keeps_it() -> None:
    claims = SlotPool(32, SIZE).claims()
    claims.rely("r0", [1, 2, 3, 4, 5], [2, 5], 0, ())  # r0 computed block 5's first slot only
    claims.rely("r1", [1, 2, 3, 4, 5, 6, 7], [2, 5], 0, ())  # r1 three of it
    first = claims.get(2 * SIZE + 1)
    assert first is not None and first.request == "r0"
    second = claims.get(5 * SIZE + 2)
    assert second is not None and (second.request, second.position) == ("r1", 6)


def test_a_block_twice_in_one_table_is_claimed_for_its_first_entry() -> None:
    claims = SlotPool(32, SIZE).claims()
    claims.rely("r0", [1, 2, 3, 4, 5, 6, 7, 8], [6, 6], 0, ())
    held = claims.get(6 * SIZE + 1)
    assert held is not None and held.position == 1


def test_a_write_over_a_slot_a_request_relies_on_through_its_table_breaks_exclusivity() -> None:
    pool = SlotPool(32, SIZE)
    claims = pool.claims()
    claims.rely("r0", [1, 2, 3, 4, 5], [2, 5], 0, ())
    with pytest.raises(SchedulerViolation) as raised:
        pool.write("r1", [9, 9, 9, 9, 9], range(4, 5), [5 * SIZE], 3, claims)
    assert raised.value.check is Check.EXCLUSIVE
    assert "which request r0 relies on for its position 4" in str(raised.value)
    assert raised.value.cause == "a shared cached prefix block"


def test_a_write_of_the_same_content_as_the_claim_is_no_violation_and_claims_the_slot_for_the_step() -> None:
    pool = SlotPool(32, SIZE)
    claims = pool.claims()
    claims.rely("r0", [1, 2, 3, 4, 5], [2, 5], 0, ())
    pool.write("r1", [1, 2, 3, 4, 5], range(4, 5), [5 * SIZE], 3, claims)
    written = claims.get(5 * SIZE)
    assert written is not None and (written.request, written.why) == ("r1", "wrote this step")
    with pytest.raises(SchedulerViolation) as raised:
        pool.write("r2", [1, 2, 3, 4, 6], range(4, 5), [5 * SIZE], 3, claims)
    assert raised.value.cause == "two writes to one slot in a step"


def test_the_contents_are_the_k_v_of_each_slots_last_write_and_zeros_elsewhere() -> None:
    pool = SlotPool(12, SIZE)
    pool.write("r0", [1, 2, 3], range(3), [4, 9, 11], 1, pool.claims(), ("salt", "b"))
    pool.copy_block(1, 0)  # slots 0..3 take slots 4..7
    keys, values = pool.contents()
    tags = prefix_tags(("salt", "b"), [1, 2, 3])
    want_keys, want_values = kv_for_tags([tags[0], tags[1], tags[2], tags[0]], MODEL_SHAPE)
    for index, slot in enumerate([4, 9, 11, 0]):
        assert torch.equal(keys[slot], want_keys[index]) and torch.equal(values[slot], want_values[index])
    for slot in [1, 2, 3, 5, 6, 7, 8, 10]:
        assert not keys[slot].any() and not values[slot].any()


def test_the_content_check_compares_what_the_slots_hold_not_who_wrote_it() -> None:
    """Two requests with a common prefix write the same K/V: either one's write serves the other."""
    pool = SlotPool(16, SIZE)
    pool.write("r0", [1, 2, 3, 4], range(4), [0, 1, 2, 3], 1, pool.claims())
    pool.check("r1", [1, 2, 3, 4], [0, 1, 2, 3], 2, hit=4)
    with pytest.raises(SchedulerViolation) as raised:
        pool.check("r1", [1, 2, 3, 4], [0, 1, 2, 3], 2, ("salt", "c"), hit=4)
    assert raised.value.check is Check.CONTENT and "position 0 (block 0, slot 0)" in str(raised.value)


def test_the_tag_memo_gives_prefix_tags_whatever_the_sequence_does() -> None:
    memo = TagMemo()
    rng = random.Random(7)
    tokens: list[int] = []
    namespace: tuple[str, ...] = ()
    for _ in range(400):
        move = rng.random()
        if move < 0.5:
            tokens = tokens + [rng.randrange(4) for _ in range(rng.randint(1, 3))]
        elif move < 0.7:
            tokens = tokens[: rng.randint(0, len(tokens))]
        elif move < 0.85 and tokens:
            changed = rng.randrange(len(tokens))
            tokens = tokens[:changed] + [(tokens[changed] + 1) % 4] + tokens[changed + 1 :]
        else:
            namespace = rng.choice([(), ("salt", "a"), ("kv-cache group 1",)])
        key = "r0" if rng.random() < 0.8 else "r1"
        got = memo.tags(key, namespace, tokens)
        assert got == prefix_tags(namespace, tokens)
        got.append(0)  # a caller's list is its own: the memo's stays as it was
        assert memo.tags(key, namespace, tokens) == prefix_tags(namespace, tokens)
