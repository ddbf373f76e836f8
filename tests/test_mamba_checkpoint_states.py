"""The runner's prefill checkpoints in kvfuzz's Mamba state model (kvfuzz/scheduler/mamba_states.py's
CheckpointingAlignStates) and where the configuration takes them (kvfuzz/scheduler/config.py): hand-written rules and
tables, no vLLM. vLLM's own rule and scheduler are exercised in
engine_tests/test_vllm_scheduler_mamba_checkpoints.py."""

from __future__ import annotations

from typing import Optional

import pytest

from kvfuzz.reference.content import prefix_tags
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.groups import group_namespace
from kvfuzz.scheduler.mamba_states import CheckpointingAlignStates, mamba_states
from kvfuzz.scheduler.violations import SchedulerViolation

TOKENS = [5, 6, 7, 8, 9, 10, 11, 12, 13]
SALT = ("r0",)


def at_eight(seq_len: int, query_len: int) -> Optional[tuple[int, int]]:
    """A rule exporting the state after 8 tokens into entry 1 for a chunk that crosses 8 and ends at 9."""
    return (8, 1) if seq_len == 9 and query_len > 1 else None


def tag(length: int) -> int:
    return prefix_tags(group_namespace(0) + SALT, TOKENS[:length])[length - 1]


def test_a_chunk_crossing_the_checkpoint_writes_it_beside_its_state() -> None:
    states = mamba_states((0,), "align", 4, 4, at_eight)
    assert isinstance(states, CheckpointingAlignStates)
    states.step("r0", [[3, 4, 5]], TOKENS, range(0, 9), SALT, 1, {"r0": [3, 4, 5]})
    assert states.states[(0, 4)].length == 8 and states.states[(0, 4)].tag == tag(8)
    assert states.states[(0, 5)].length == 9 and states.states[(0, 5)].tag == tag(9)
    assert (0, 3) not in states.states
    assert states.touched([[3, 4, 5]], range(0, 9)) == ({5}, {4, 5})


def test_a_checkpoint_on_a_null_entry_is_a_scratch_write() -> None:
    states = mamba_states((0,), "align", 4, 4, at_eight)
    states.step("r0", [[0, 0, 5]], TOKENS, range(0, 9), SALT, 1, {"r0": [5]})
    assert set(states.states) == {(0, 5)}
    assert states.touched([[0, 0, 5]], range(0, 9))[1] == {5}


def test_a_hit_on_the_checkpoint_reads_the_state_written_there() -> None:
    states = mamba_states((0,), "align", 4, 4, at_eight)
    states.step("r0", [[3, 4, 5]], TOKENS, range(0, 9), SALT, 1, {"r0": [3, 4, 5]})
    # another request of the same prefix resumes from 8 computed tokens, its entry 1 the checkpoint block 4
    states.step("r1", [[0, 4, 6]], TOKENS, range(8, 9), SALT, 2, {"r1": [4, 6]})
    with pytest.raises(SchedulerViolation, match="should hold a checkpoint of its prefix"):
        # block 5 holds the state after 9 tokens, not 8: a hit handed the wrong block fails
        states.step("r2", [[0, 5, 7]], TOKENS, range(8, 9), SALT, 3, {"r2": [5, 7]})


def test_the_checkpoint_block_must_be_the_requests_own() -> None:
    states = mamba_states((0,), "align", 4, 4, at_eight)
    with pytest.raises(SchedulerViolation, match="also a block request r1 still holds"):
        states.step("r0", [[3, 4, 5]], TOKENS, range(0, 9), SALT, 1, {"r0": [3, 4, 5], "r1": [4]})


def test_checkpoints_are_refused_outside_align_mode() -> None:
    with pytest.raises(ValueError, match="align mode only"):
        mamba_states((0,), "none", 4, 4, at_eight)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"model": "full"}, "needs model mamba-hybrid with prefix caching"),
        ({"model": "mamba-hybrid", "prefix_caching": False}, "needs model mamba-hybrid with prefix caching"),
        ({"model": "mamba-hybrid", "speculative_tokens": 1}, "not driven with speculative decoding"),
    ],
)
def test_the_configuration_refuses_checkpoints_where_vllm_or_kvfuzz_has_none(fields: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        SchedulerSetup(mamba_checkpoints=True, **fields)


def test_the_checkpoint_block_shortens_the_longest_request() -> None:
    plain = SchedulerSetup(model="mamba-hybrid", num_blocks=8, block_size=4)
    checkpointing = SchedulerSetup(model="mamba-hybrid", num_blocks=8, block_size=4, mamba_checkpoints=True)
    assert checkpointing.max_model_len == plain.max_model_len - 4
