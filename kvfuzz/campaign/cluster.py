"""Campaigns on several machines: everything they share lives in one Redis, named by ``--database redis://HOST:PORT/N``.

Three hashes, each keyed by a signature's :meth:`~kvfuzz.shrink.signature.Signature.key`:

* ``kvfuzz:signatures``, the claims: the first worker anywhere to meet a signature claims it (``HSETNX``) and only
  that worker shrinks and saves it; every other worker counts it as found earlier;
* ``kvfuzz:seen``, how often each signature was met, by every campaign;
* ``kvfuzz:findings``, the findings themselves: the shrunk trace of each claimed signature, with where, when and
  under which seed it was found (a :data:`FINDING_FORMAT` record), so that ``kvfuzz findings`` on any machine lists
  and writes every machine's traces.

A finding is stored by one Lua script, atomic on the server: a record goes in when the hash has none for its key, or
when its program is strictly shorter than the one stored (a record that cannot be read counts as none); otherwise
the stored one stays. Two machines storing the same signature at once therefore leave one record, the shorter
program's (the first one's when they are as long). Hypothesis's example database lives in the same server
(``hypothesis[redis]``), under keys of its own.

What comes back from Redis is untrusted, like a trace file from a stranger: :func:`parse_finding` checks a record's
bytes as a trace file's are checked (:func:`kvfuzz.trace_files.parse_json`), its trace field as a trace
(:func:`kvfuzz.saved.trace.from_json`), and each other field's type and size, each problem one
:class:`~kvfuzz.saved.trace.TraceError` line.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import urllib.parse
from typing import Any, Optional, TypeGuard

import attrs

from kvfuzz.saved.trace import Trace, TraceError, from_json
from kvfuzz.scheduler import trace as scheduler_trace
from kvfuzz.scheduler.trace import SchedulerTrace
from kvfuzz.shrink.signature import Signature
from kvfuzz.trace_files import parse_json, show

REDIS_SIGNATURES = "kvfuzz:signatures"
"""The Redis hash of claimed signatures: signature key -> JSON record (the signature, where it was found)."""
REDIS_SEEN = "kvfuzz:seen"
"""The Redis hash counting how often each signature was met, by every campaign sharing the server."""
REDIS_FINDINGS = "kvfuzz:findings"
"""The Redis hash of findings: signature key -> a :data:`FINDING_FORMAT` record with the shrunk trace."""
FINDING_FORMAT = "kvfuzz-finding/1"
"""The format of a record of :data:`REDIS_FINDINGS`."""
MAX_FIELD = 1000  # characters of a record's machine, time or trace file name
MAX_FINDINGS = 10_000
"""The most findings :class:`ClusterFindings` lists: a server holding more is refused (campaigns store one per
distinct failure, so thousands already mean someone else's data)."""
MAX_RECORD = 16 * 1024 * 1024
"""The most bytes of one finding record :class:`ClusterFindings` fetches (a shrunk trace is a few KiB): a larger one
is reported and left on the server, never read."""
MAX_RECORDS = 64 * 1024 * 1024
"""The most bytes of records :class:`ClusterFindings` fetches in all (10,000 findings of a few KiB each take less):
the records past it are reported and left on the server, never read."""
MAX_KEY = MAX_FIELD
"""The longest key :class:`ClusterFindings` lists, in bytes (a finding's key is 16 hex digits): a longer one is
counted on the server and never sent."""


class TooLarge(ValueError):
    """What a server holds is more than kvfuzz reads; the message says how much, in one line."""


_STORE = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old then
  local ok, record = pcall(cjson.decode, old)
  if ok and type(record) == 'table' and type(record['length']) == 'number'
      and record['length'] <= tonumber(ARGV[2]) then
    return 0
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
if old then return 2 end
return 1
"""
"""Store ARGV[3] under ARGV[1] unless a readable record with a program of at most ARGV[2] calls is there: 1 when
stored, 2 when it replaced a longer one (or one that could not be read), 0 when the stored one stays."""
STORE_OUTCOMES = {1: "stored", 2: "replaced", 0: "kept"}

_KEYS = """
local short, long = {}, 0
for _, key in ipairs(redis.call('HKEYS', KEYS[1])) do
  if #key <= tonumber(ARGV[1]) then short[#short + 1] = key else long = long + 1 end
end
return {short, long}
"""
"""The keys of hash KEYS[1] of at most ARGV[1] bytes, and how many are longer: run on the server, so that a long
key is never sent."""


def is_redis(database: Optional[str]) -> TypeGuard[str]:
    """Whether ``--database`` names a Redis (``redis://...``) rather than a directory."""
    return database is not None and database.startswith("redis://")


def check_redis_url(url: str) -> None:
    """``redis://host:port/N`` with a port and a database number; ``ValueError`` (one line) otherwise, or when the
    server does not answer."""
    parsed = urllib.parse.urlsplit(url)
    try:
        port = parsed.port
    except ValueError:
        raise ValueError(f"--database {url}: the port is not a number (expected redis://HOST:PORT/N)") from None
    database = parsed.path.lstrip("/")
    if not parsed.hostname or port is None or not database.isdigit():
        raise ValueError(f"--database {url}: expected redis://HOST:PORT/N (a host, a port and a database number)")
    client = redis_client(url)
    try:
        client.ping()
    except Exception as error:  # noqa: BLE001 -- whatever the client says, in one line
        raise ValueError(f"--database {url}: cannot reach Redis ({' '.join(str(error).split())})") from None


def redis_client(url: str) -> Any:
    """A client of the server ``url`` names, with short timeouts (a campaign must not hang on an unreachable server)."""
    try:
        import redis
    except ImportError:
        raise ValueError(
            "--database redis://...: the redis client is not installed (pip install 'hypothesis[redis]')"
        ) from None
    return redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=10)


class RedisStore:
    """Signatures in one Redis hash, shared by campaigns on every machine that reaches the server."""

    def __init__(self, url: str) -> None:
        self.client = redis_client(url)  # one connection per process: never shared across fork

    def claim(self, signature: Signature, record: dict[str, Any]) -> Optional[dict[str, Any]]:
        key = signature.key()
        if self.client.hsetnx(REDIS_SIGNATURES, key, json.dumps(record)):
            return None
        stored = self.client.hget(REDIS_SIGNATURES, key)
        try:
            found = json.loads(stored) if stored is not None else {}
        except ValueError:
            found = None
        # what another machine stored is untrusted: anything but an object stands for a claim with nothing to say
        return found if isinstance(found, dict) else {"signature": signature.to_json()}

    def seen(self, signature: Signature) -> None:
        self.client.hincrby(REDIS_SEEN, signature.key(), 1)


def finding_record(
    trace: Trace | SchedulerTrace,
    signature: Signature,
    seed: Optional[int],
    worker_seed: Optional[int],
    trace_file: Optional[str],
) -> dict[str, Any]:
    """The record of one finding as this machine stores it: the trace, its signature and length, this machine's
    hostname and pid, the time (UTC, ISO 8601), the campaign's seed and the finding worker's own seed stream, and
    where the finder saved the trace locally (None when it could not)."""
    return {
        "format": FINDING_FORMAT,
        "signature": signature.to_json(),
        "length": len(trace.program),
        "machine": socket.gethostname(),
        "pid": os.getpid(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seed": seed,
        "worker_seed": worker_seed,
        "trace_file": trace_file,
        "trace": trace.to_json(),
    }


@attrs.frozen
class Shared:
    """What became of a finding offered to the Redis campaigns share (:meth:`ClusterFindings.share`): ``outcome``,
    one of :data:`STORE_OUTCOMES`, or None when the server failed, ``problem`` saying how (one line)."""

    outcome: Optional[str]
    problem: Optional[str] = None

    def __str__(self) -> str:
        return self.outcome if self.outcome is not None else f"not stored ({self.problem})"

    def noted(self, note: Optional[str]) -> Optional[str]:
        """A saved finding's ``note``, saying that the server failed where it did (the local trace stands all the
        same)."""
        if self.problem is None:
            return note
        problem = f"not stored in Redis ({self.problem})"
        return f"{note}; {problem}" if note else problem


class ClusterFindings:
    """The findings every campaign sharing one Redis stored (:data:`REDIS_FINDINGS`)."""

    def __init__(self, url: str) -> None:
        self.url = url  # redis://HOST:PORT/N, checked by the caller
        self.client = redis_client(url)  # one connection per process: never shared across fork

    def store(self, key: str, record: dict[str, Any]) -> str:
        """Store ``record`` under ``key`` atomically, by the policy of the module's docstring; returns a value of
        :data:`STORE_OUTCOMES`: ``stored``, ``replaced`` (a longer program was there) or ``kept`` (not stored)."""
        outcome = self.client.eval(_STORE, 1, REDIS_FINDINGS, key, int(record["length"]), json.dumps(record))
        return STORE_OUTCOMES[int(outcome)]

    def share(
        self,
        trace: Trace | SchedulerTrace,
        signature: Signature,
        seed: Optional[int],
        worker_seed: Optional[int],
        trace_file: Optional[str],
    ) -> Shared:
        """Store one new finding of any target (its :func:`finding_record`) under its signature's key; a server that
        fails (went away mid-campaign, say) is said, never raised: the finding's trace is in the corpus all the
        same."""
        try:
            return Shared(self.store(signature.key(), finding_record(trace, signature, seed, worker_seed, trace_file)))
        except Exception as error:  # noqa: BLE001 -- the server failing mid-campaign: said, not fatal
            return Shared(None, " ".join(str(error).split()))

    def keys(self) -> StoredKeys:
        """The keys of every stored finding (whatever their records hold) of at most :data:`MAX_KEY` bytes, and how
        many are longer (never read); :class:`TooLarge` when there are more than :data:`MAX_FINDINGS`, counted
        before any is read."""
        count = int(self.client.hlen(REDIS_FINDINGS))
        if count > MAX_FINDINGS:
            raise TooLarge(f"{self.url} holds {count} findings, more than the {MAX_FINDINGS} kvfuzz findings reads")
        short, too_long = self.client.eval(_KEYS, 1, REDIS_FINDINGS, MAX_KEY)
        return StoredKeys(sorted(_text(key) for key in short), int(too_long))

    def fetch(self, keys: list[str]) -> dict[str, Optional[bytes] | TooLarge]:
        """The raw record of each key (None for a key with none: deleted since it was listed), in batches of at most
        :data:`MAX_RECORD` bytes; a :class:`TooLarge` instead, measured before anything is read, for a record over
        :data:`MAX_RECORD` bytes and for each record (in ``keys``'s order) once those read reach
        :data:`MAX_RECORDS` bytes in all."""
        if not keys:
            return {}
        sizes = dict(zip(keys, (int(size) for size in self._sizes(keys))))
        found: dict[str, Optional[bytes] | TooLarge] = {}
        batches: list[list[str]] = [[]]
        batch_bytes = total = 0
        for key in keys:
            if sizes[key] > MAX_RECORD:
                found[key] = TooLarge(
                    f"a record of {sizes[key]} bytes, more than the {MAX_RECORD} kvfuzz findings reads"
                )
            elif total + sizes[key] > MAX_RECORDS:
                found[key] = TooLarge(
                    f"a record of {sizes[key]} bytes past the {MAX_RECORDS} kvfuzz findings reads in all (name fewer "
                    "findings)"
                )
            else:
                if batch_bytes + sizes[key] > MAX_RECORD:
                    batches.append([])
                    batch_bytes = 0
                batches[-1].append(key)
                batch_bytes += sizes[key]
                total += sizes[key]
        for batch in batches:
            if batch:
                found.update(zip(batch, self.client.hmget(REDIS_FINDINGS, batch)))
        return {key: found[key] for key in keys}

    def _sizes(self, keys: list[str]) -> list[Any]:
        pipeline = self.client.pipeline(transaction=False)
        for key in keys:
            pipeline.hstrlen(REDIS_FINDINGS, key)
        return list(pipeline.execute())


@attrs.frozen
class StoredKeys:
    """The keys of the stored findings that :class:`ClusterFindings` lists, and how many it does not (too long)."""

    keys: list[str]  # sorted
    too_long: int  # keys over MAX_KEY bytes, counted on the server, never read


@attrs.frozen
class StoredFinding:
    """One finding read back from Redis and validated (:func:`parse_finding`)."""

    key: str  # its signature's key: the field of kvfuzz:findings it was read from
    signature: Signature  # what makes it one finding
    trace: Trace | SchedulerTrace  # the shrunk trace (an allocator's or a scheduler's), validated as its file is
    machine: str  # the hostname of the machine that found it
    pid: int  # the process there that stored it: the finding worker (the campaign, for a dead worker's program)
    time: str  # when it was stored, UTC, ISO 8601
    seed: Optional[int]  # the finding campaign's --seed
    worker_seed: Optional[int]  # the finding worker's own seed stream
    trace_file: Optional[str]  # where the finder saved the trace on its machine (None when it could not)

    @property
    def text(self) -> str:
        """The signature in words: the failure, the operation and for a crash the frame (the table's column)."""
        return str(self.signature)


def parse_finding(key: str, raw: bytes, source: str) -> StoredFinding:
    """A record of :data:`REDIS_FINDINGS` read back and checked: ``TraceError`` (one line starting with ``source``)
    for anything that is not a :data:`FINDING_FORMAT` record whose trace is a valid trace, whose signature is the
    one ``key`` names and whose length is its trace's."""
    data = parse_json(raw, source, TraceError)
    if not isinstance(data, dict):
        raise TraceError(f"{source}: not a kvfuzz finding record (a JSON object)")
    fields = {"format", "signature", "length", "machine", "pid", "time", "seed", "worker_seed", "trace_file", "trace"}
    unknown = sorted(set(data) - fields)
    missing = sorted(fields - set(data))
    if unknown or missing:
        problem = f"unknown field {show(unknown[0])}" if unknown else f"no field {show(missing[0])}"
        raise TraceError(f"{source}: {problem} (a {FINDING_FORMAT} record)")
    if data["format"] != FINDING_FORMAT:
        raise TraceError(f"{source}: format {show(data['format'])}, not {FINDING_FORMAT} (another kvfuzz's record?)")
    trace = _trace(data["trace"], f"{source}: trace")
    signature = _signature(data["signature"], source)
    target = trace.scheduler if isinstance(trace, SchedulerTrace) else trace.allocator
    if signature.key() != key or signature.allocator != target:
        raise TraceError(f"{source}: its signature is not the one its key names, or not of its trace's allocator")
    if data["length"] != len(trace.program) or isinstance(data["length"], bool):
        raise TraceError(f"{source}: length {show(data['length'])} is not its trace's {len(trace.program)} calls")
    return StoredFinding(
        key,
        signature,
        trace,
        _string(data, "machine", source),
        _integer(data, "pid", source),
        _string(data, "time", source),
        _integer(data, "seed", source, optional=True),
        _integer(data, "worker_seed", source, optional=True),
        _string(data, "trace_file", source, optional=True),
    )


def _trace(value: Any, source: str) -> Trace | SchedulerTrace:
    """An allocator trace, or a scheduler trace where its format (at any version) says so, checked as its file
    would be."""
    if scheduler_trace.SCHEDULER_TRACE_FORMAT.names(value):
        try:
            return scheduler_trace.from_json(value, source)
        except ValueError as error:
            raise TraceError(str(error)) from None
    return from_json(value, source)


def _signature(value: Any, source: str) -> Signature:
    names = ("allocator", "failure", "operation", "frame", "cause")
    if not isinstance(value, dict) or not set(names) - {"cause"} <= set(value) <= set(names):
        raise TraceError(f"{source}: signature: expected an object with {', '.join(names)} (cause optional)")
    where = f"{source}: signature"
    return Signature(
        _string(value, "allocator", where),
        _string(value, "failure", where),
        _string(value, "operation", where, optional=True),
        _string(value, "frame", where, optional=True),
        _string(value, "cause", where, optional=True) if "cause" in value else None,
    )


def _string(data: dict[str, Any], name: str, source: str, optional: bool = False) -> Any:
    value = data[name]
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > MAX_FIELD or not value.isprintable():
        raise TraceError(f"{source}: {name}: expected a printable string of at most {MAX_FIELD} characters")
    return value


def _integer(data: dict[str, Any], name: str, source: str, optional: bool = False) -> Any:
    value = data[name]
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not -(2**63) <= value < 2**64:
        raise TraceError(f"{source}: {name}: expected an integer, not {show(value)}")
    return value


def _text(key: Any) -> str:
    return key.decode("utf-8", "backslashreplace") if isinstance(key, bytes) else str(key)
