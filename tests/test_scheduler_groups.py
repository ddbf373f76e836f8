"""What the worker holds each KV-cache group to (kvfuzz.scheduler.groups): the positions a step's tokens attend in
it, and the table entries vLLM may have released, worked by hand for each kind of group."""

from __future__ import annotations

from kvfuzz.scheduler.groups import GroupRule

FULL = GroupRule(0, None)
SLIDING = GroupRule(1, 8)
CHUNKED = GroupRule(1, None, chunk=4)
RSWA = GroupRule(0, 8, keeps_prompt=True)


def test_full_attention_reads_everything_and_releases_nothing() -> None:
    assert FULL.attended(20, 22, 5) == (range(0, 22),)
    assert FULL.released_entries(20, 5, 4) == range(0, 0)


def test_a_sliding_window_reads_its_window_and_may_release_what_lies_before() -> None:
    assert SLIDING.attended(20, 22, 5) == (range(13, 22),)  # the token at 20 attends 13..20
    assert SLIDING.released_entries(20, 5, 4) == range(0, 3)  # entries 0..2 lie wholly before position 13


def test_chunked_local_attention_reads_its_chunk() -> None:
    assert CHUNKED.attended(9, 11, 5) == (range(8, 11),)
    assert CHUNKED.released_entries(9, 5, 4) == range(0, 2)


def test_rswa_reads_the_prompt_and_the_window_and_may_release_the_gap_between() -> None:
    # a prompt of 5 tokens; the token at position 20 attends 0..4 and 13..20
    assert RSWA.attended(20, 20, 5) == (range(0, 5), range(13, 20))
    assert RSWA.attended(20, 22, 5) == (range(0, 5), range(13, 22))  # a step computing 20 and 21
    assert RSWA.attended(9, 9, 5) == (range(0, 9),)  # the window reaches back into the prompt
    # blocks of 4: entry 1 (positions 4..7) holds the prompt's last token; entry 2 (8..11) is in the gap
    assert RSWA.released_entries(20, 5, 4) == range(2, 3)
    assert RSWA.released_entries(9, 5, 4) == range(2, 2)  # nothing: the window reaches back into the prompt
    assert "reference sliding window of 8 tokens, the prompt kept" in RSWA.describe()
    assert not RSWA.reads_all and FULL.reads_all
