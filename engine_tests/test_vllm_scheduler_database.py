"""``kvfuzz run --scheduler vllm-v1 --database DIR``: the search is random, Hypothesis keeps a failing example in
the example database, and the next run replays it first: one example suffices to meet the seeded bug again, where
a run of one example without the database passes.

Runs in the vLLM environment (``scripts/third_party_env.sh vllm``; CI runs it there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm.v1.core.block_pool import BlockPool

from kvfuzz.cli import main

RUN = ["run", "--scheduler", "vllm-v1", "--num-blocks", "8", "--no-shrink", "--json"]


def test_the_example_database_keeps_the_failure_for_the_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(BlockPool, "touch", lambda self, blocks: None)  # a prefix hit that takes no reference
    database = tmp_path / "examples"
    corpus = ["--corpus", str(tmp_path / "corpus")]
    assert main([*RUN, "--examples", "1", *corpus]) == 0  # one derandomized example does not meet it
    capsys.readouterr()
    assert main([*RUN, "--examples", "60", "--database", str(database), *corpus]) == 1
    first = json.loads(capsys.readouterr().out)
    assert first["check"] == "accounting" and any(path.is_file() for path in database.rglob("*"))
    assert main([*RUN, "--examples", "1", "--database", str(database), *corpus]) == 1
    again = json.loads(capsys.readouterr().out)
    # the saved example, replayed first (and once more as Hypothesis reports it): no new example drawn
    assert again["check"] == "accounting" and again["examples"] <= 2
