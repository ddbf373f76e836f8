"""``kvfuzz campaign --scheduler vllm-v1 --database redis://...`` without vLLM (the fake scheduler of
tests/test_scheduler_campaign.py): two campaigns on different corpora and seeds, as two machines, store their
finding's trace in a real ``redis-server`` once; ``kvfuzz findings --database`` lists it beside the allocators' and
writes it as a scheduler trace file, the one the first campaign saved. (A directory as --database is refused:
tests/test_scheduler_campaign.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_campaign_redis import redis_url  # noqa: F401 -- the fixture: a real redis-server on a free port
from test_scheduler_campaign import FakeTarget

from kvfuzz.campaign.cluster import REDIS_FINDINGS, REDIS_SEEN, ClusterFindings
from kvfuzz.scheduler.trace import load


def scheduler_campaign(url: str, corpus: Path, seed: int) -> tuple[int, dict[str, Any]]:
    from kvfuzz.cli import _parser
    from kvfuzz.commands.scheduler_campaign import scheduler_campaign

    argv = ["campaign", "--scheduler", "vllm-v1", "--seed", str(seed), "--max-examples", "200", "--no-known"]
    emitted: list[Any] = []
    args = _parser().parse_args([*argv, "--corpus", str(corpus), "--database", url, "--json"])
    status = scheduler_campaign(args, emitted.append, FakeTarget().target())
    return status, emitted[0]


def test_two_campaigns_store_a_scheduler_finding_once_and_findings_writes_it(
    redis_url: str,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvfuzz.cli import main

    status, first = scheduler_campaign(redis_url, tmp_path / "a", 3)
    assert status == 1 and len(first["failures"]) == 1, first
    assert f"--database {redis_url}" in first["rerun_command"] and first["rerun"]["database"] == redis_url
    [finding] = first["failures"]
    assert f"{redis_url}: stored" in capsys.readouterr().err
    # another machine's campaign: the signature is claimed in the Redis, so it is counted there, not found again
    status, second = scheduler_campaign(redis_url, tmp_path / "b", 11)
    assert status == 0 and not second["failures"], second
    [known] = second["known"]
    assert known["text"] == finding["text"] and known["known"].startswith("found earlier by "), known
    assert not list((tmp_path / "b").glob("*.json")), "a finding claimed elsewhere saves no second trace"
    assert len(ClusterFindings(redis_url).keys().keys) == 1
    # every meeting counted in the Redis (the first campaign's claim, the second's meeting), and the finding stored
    # with the finding worker's own seed stream (a one-worker campaign's is its --seed), as an allocator's is
    client = ClusterFindings(redis_url).client
    [key] = ClusterFindings(redis_url).keys().keys
    assert int(client.hget(REDIS_SEEN, key)) >= 2
    assert json.loads(client.hget(REDIS_FINDINGS, key))["worker_seed"] == 3

    out = tmp_path / "fetched"
    assert main(["findings", "--database", redis_url, "--json", "-o", str(out)]) == 0
    [listed] = json.loads(capsys.readouterr().out)["findings"]
    assert listed["text"] == finding["text"] and listed["allocator"] == "vllm-v1" and listed["seed"] == 3
    assert listed["trace_file"] == finding["trace"] and listed["config"]["num_blocks"] <= 6
    fetched = load(Path(listed["file"]))
    assert fetched == load(Path(finding["trace"])) and fetched.shrunk
    assert FakeTarget().replay(fetched, None).error is not None  # what `kvfuzz replay` runs on the real scheduler

    assert main(["findings", "--database", redis_url]) == 0
    table = capsys.readouterr().out
    assert "vllm-v1" in table and "1 finding in" in table


def test_a_scheduler_finding_stored_with_a_broken_trace_is_refused_in_one_line(
    redis_url: str,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvfuzz.cli import main

    assert scheduler_campaign(redis_url, tmp_path / "a", 3)[0] == 1
    [key] = ClusterFindings(redis_url).keys().keys
    client = ClusterFindings(redis_url).client
    record = json.loads(client.hget(REDIS_FINDINGS, key))
    record["trace"]["config"]["num_blocks"] = -1
    client.hset(REDIS_FINDINGS, key, json.dumps(record))
    capsys.readouterr()
    assert main(["findings", "--database", redis_url, "-o", str(tmp_path / "out")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kvfuzz: {redis_url} finding {key}: trace: ") and "num_blocks" in line, line
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_an_allocator_campaign_on_the_same_redis_passes_over_scheduler_findings(
    redis_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    from kvfuzz.campaign.allocators import AllocatorTraces
    from kvfuzz.campaign.known import stored_findings_known

    assert scheduler_campaign(redis_url, tmp_path / "a", 3)[0] == 1
    assert len(ClusterFindings(redis_url).keys().keys) == 1
    cluster = ClusterFindings(redis_url)
    source = AllocatorTraces(["vllm-v1", "kvfuzz.allocator.paged:paged_allocator"], 5.0)
    assert stored_findings_known(cluster, source).where() == {}


def test_a_scheduler_finding_stored_under_an_earlier_key_is_known_under_todays(
    redis_url: str,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A finding stored before its check named a cause (say): its record's key is no longer its signature's. The
    # next campaign replays it, as a corpus trace, and counts the bug under today's key instead of shrinking and
    # storing it a second time.
    import attrs

    from kvfuzz.campaign.cluster import finding_record, parse_finding
    from kvfuzz.campaign.known import stored_findings_known
    from kvfuzz.campaign.scheduler.target import SchedulerTraces

    assert scheduler_campaign(redis_url, tmp_path / "a", 3)[0] == 1
    cluster = ClusterFindings(redis_url)
    [today] = cluster.keys().keys
    stored = parse_finding(today, cluster.fetch([today])[today] or b"", "today")
    old = attrs.evolve(stored.signature, cause="an earlier wording of the cause")
    cluster.client.hdel(REDIS_FINDINGS, today)
    cluster.store(old.key(), finding_record(stored.trace, old, 3, None, None))

    known = stored_findings_known(cluster, SchedulerTraces(FakeTarget().target(), None))
    assert list(known.where()) == [today] and "re-keyed on load" in known.where()[today], known
    status, second = scheduler_campaign(redis_url, tmp_path / "b", 11)
    assert status == 0 and not second["failures"], second
    assert [entry["known"] for entry in second["known"]] == [known.where()[today]]
    assert cluster.keys().keys == [old.key()], "nothing stored a second time"
