"""Several KV-cache groups per sequence (vLLM's hybrid models): the contract's declaration and its validation."""

from __future__ import annotations

import pytest

from kvfuzz.allocator import Capabilities, KVGroup
from kvfuzz.allocator.protocol import declares

HYBRID = (KVGroup("full"), KVGroup("sliding", sliding_window=8))


def test_groups_bring_the_group_tables_method():
    assert declares(Capabilities(kv_groups=HYBRID), "group_block_tables")
    assert not declares(Capabilities(), "group_block_tables")


@pytest.mark.parametrize(
    ("changes", "complaint"),
    [
        ({"kv_groups": HYBRID[:1]}, "two or more groups"),
        ({"kv_groups": (KVGroup("a"), KVGroup("a"))}, "names must differ"),
        ({"kv_groups": HYBRID, "sliding_window": 8}, "sliding_window must be None"),
        ({"kv_groups": HYBRID, "swap": True}, "swap"),
        ({"kv_groups": HYBRID, "host_cache": True}, "host_cache"),
        ({"kv_groups": ("full", "sliding")}, "KVGroup values"),
    ],
)
def test_a_grouped_declaration_kvfuzz_cannot_check_is_refused(changes, complaint):
    with pytest.raises(ValueError, match=complaint):
        Capabilities(**changes)


def test_a_group_needs_a_name_and_a_positive_window():
    with pytest.raises(ValueError):
        KVGroup("")
    with pytest.raises(ValueError):
        KVGroup("sliding", sliding_window=0)
