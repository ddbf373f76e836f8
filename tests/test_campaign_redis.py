"""Campaigns sharing one Redis: the failure signatures and Hypothesis's example database.

These tests start a real ``redis-server`` (installed by ``.ci/run`` with apt). Without one they FAIL, loudly: a
campaign across machines that was never run against Redis is not a feature."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
from factories import kvfuzz


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed: apt-get install -y redis-server (.ci/run installs it)")
    port = _free_port()
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"redis-server did not start on port {port}")
                time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


def _campaign(cwd: Path, redis_url: str, corpus: str) -> dict:
    (cwd / "no-known").mkdir(exist_ok=True)
    done = kvfuzz(
        "campaign",
        "--json",
        "--allocator",
        "zoo:NoCopyOnWrite",
        "--database",
        redis_url,
        "--corpus",
        corpus,
        "--known",
        "no-known",
        "--max-examples",
        "300",  # batches of random programs, and Hypothesis rounds that find the bug too and save it there
        "--workers",
        "1",
        "--seed",
        "2",  # the same programs in both campaigns: the second meets what the first found
        cwd=cwd,
    )
    assert done.stdout, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
def test_a_second_campaign_on_the_same_redis_does_not_report_the_firsts_findings_again(
    tmp_path: Path, redis_url: str
) -> None:
    first = _campaign(tmp_path, redis_url, "corpus-a")
    assert first["failures"], first
    found = {json.dumps(failure["signature"], sort_keys=True) for failure in first["failures"]}
    for failure in first["failures"]:
        assert failure["trace"].startswith("corpus-a/")
    # Another machine: its own, empty corpus; only the Redis is shared.
    second = _campaign(tmp_path, redis_url, "corpus-b")
    met_again = {json.dumps(entry["signature"], sort_keys=True): entry for entry in second["known"]}
    new_again = {json.dumps(failure["signature"], sort_keys=True) for failure in second["failures"]}
    # The same seed draws the same programs, so the second meets the first's findings (one met late in a Hypothesis
    # round may be missed: the shared database's replays shift that round's draws); it counts each one it meets as
    # found earlier, and reports none of them as new.
    assert met_again and set(met_again) <= found, (first, second)
    assert not found & new_again, (first, second)
    for entry in met_again.values():
        assert entry["known"].startswith("found earlier by ")
    assert len(list((tmp_path / "corpus-b").glob("*.json"))) == len(new_again)  # nothing of the first's saved again
    # Hypothesis's example database lives in the same server.
    import redis

    keys = redis.Redis.from_url(redis_url).keys("*")
    assert b"kvfuzz:signatures" in keys
    assert any(key.startswith(b"hypothesis-example:") for key in keys), keys


def test_an_unreachable_redis_is_refused_before_any_work(tmp_path: Path) -> None:
    done = kvfuzz("campaign", "--database", f"redis://127.0.0.1:{_free_port()}/0", "--duration", "1", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and "cannot reach Redis" in done.stderr
    assert not (tmp_path / ".kvfuzz").exists()
