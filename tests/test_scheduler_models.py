"""The scheduler target's models as vLLM's planner groups them (kvfuzz.scheduler.models): how many KV-cache groups
each kind of layer makes, and the longest request the pool then admits. The expected figures are worked by hand
from vLLM's rules (docs/scheduler-models.md); the engine tests check them against vLLM's planner itself."""

from __future__ import annotations

from collections import Counter

import pytest

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.models import MODELS, group_counts


@pytest.mark.parametrize(
    ("layers", "groups"),
    [
        ({"full": 2, "sliding": 2}, {"full": 1, "sliding": 1}),  # Gemma 2's alternation: a group of two of each
        ({"full": 1, "sliding": 2}, {"full": 1, "sliding": 2}),  # 2:1, the sliding-window-groups model
        ({"full": 1, "sliding": 5}, {"full": 1, "sliding": 5}),  # Gemma 3's 5:1
        ({"full": 1, "chunked": 3}, {"full": 1, "chunked": 3}),  # Llama 4's 3:1
        ({"full": 13, "sliding": 12}, {"full": 1, "sliding": 1}),  # gpt-oss with a drafter: padded, one of each
        ({"full": 1, "mamba": 1}, {"full": 1, "mamba": 1}),
        ({"full": 2}, {"full": 1}),
    ],
)
def test_vllm_s_planner_splits_each_kind_into_groups_of_a_size(layers: dict[str, int], groups: dict[str, int]) -> None:
    assert group_counts(Counter(layers)) == groups


def test_the_sliding_window_groups_model_has_two_sliding_window_groups() -> None:
    model = MODELS["sliding-window-groups"]
    assert (model.groups_of("full"), model.groups_of("sliding")) == (1, 2)
    assert model.sliding_window(2) == 4


@pytest.mark.parametrize(
    ("setup", "longest"),
    [
        # per sliding-window group ceil(min(4 - 1 + 16, L) / 2) + 1 blocks, full attention L / 2: 2 * 8 + 7 <= 24
        (SchedulerSetup(num_blocks=24, block_size=2, model="sliding-window-groups"), 14),
        # ... and 2 * 11 + 18 <= 40
        (SchedulerSetup(num_blocks=40, block_size=2, model="sliding-window-groups"), 36),
        # the models of one group per kind keep their figures: 9 blocks of full attention, 6 of the window, 1 spare
        (SchedulerSetup(num_blocks=16, model="sliding-window"), 36),
        # full attention L / 2 and the chunk's ceil((4 + 16) / 2): 2 * (24 - 10)
        (SchedulerSetup(num_blocks=24, block_size=2, model="chunked-local"), 28),
    ],
)
def test_the_longest_request_fits_every_group_in_the_pool(setup: SchedulerSetup, longest: int) -> None:
    assert setup.max_model_len == longest
