"""Where a campaign's workers share what they found: the store of failure signatures and Hypothesis's example
database, in a local directory (the default) or in one Redis shared by workers on several machines.

A signature is *claimed* by the first worker that meets it, atomically (a file created exclusively, or Redis's
``HSETNX``): that worker shrinks and saves it; every other worker, on this machine or another, only counts it. The
example database holds the failing examples of the Hypothesis rounds, so that each is replayed first everywhere.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from pathlib import Path
from typing import Any, Optional, Protocol

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from kvfuzz.shrink.signature import Signature

REDIS_SIGNATURES = "kvfuzz:signatures"
"""The Redis hash of claimed signatures: signature key -> JSON record (the signature, where it was found)."""
REDIS_SEEN = "kvfuzz:seen"
"""The Redis hash counting how often each signature was met, by every campaign sharing the server."""


class SignatureStore(Protocol):
    """Claims signatures for the worker that shrinks them; counts the others."""

    def claim(self, signature: Signature, record: dict[str, Any]) -> Optional[dict[str, Any]]:
        """Claim ``signature`` with ``record``: None when this caller is the first (it shrinks and saves it), else
        the record its first finder stored."""
        ...

    def seen(self, signature: Signature) -> None:
        """Count one more meeting of ``signature``."""
        ...


class DirectoryStore:
    """Signatures as files in a directory, one per signature, created exclusively (for the workers of one machine)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory  # holds <key>.json per claimed signature
        directory.mkdir(parents=True, exist_ok=True)

    def claim(self, signature: Signature, record: dict[str, Any]) -> Optional[dict[str, Any]]:
        path = self.directory / f"{signature.key()}.json"
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            try:
                stored: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
                return stored
            except (OSError, ValueError):
                return {"signature": signature.to_json()}  # claimed, its record not yet written
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(record, handle)
        return None

    def seen(self, signature: Signature) -> None:
        pass  # the campaign counts meetings itself; only Redis keeps a count across campaigns


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
            found: dict[str, Any] = json.loads(stored) if stored is not None else {}
            return found
        except ValueError:
            return {"signature": signature.to_json()}

    def seen(self, signature: Signature) -> None:
        self.client.hincrby(REDIS_SEEN, signature.key(), 1)


def is_redis(database: Optional[str]) -> bool:
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


def open_store(database: Optional[str], local: Path) -> SignatureStore:
    """The signature store: Redis when ``database`` is a ``redis://`` URL, else files in ``local``."""
    if database is not None and is_redis(database):
        return RedisStore(database)
    return DirectoryStore(local)


def open_examples(database: Optional[str], local: Path) -> ExampleDatabase:
    """Hypothesis's example database: Redis (``hypothesis[redis]``) for a ``redis://`` URL, else the directory
    ``database`` names, else ``local``."""
    if database is not None and is_redis(database):
        from hypothesis.extra.redis import RedisExampleDatabase

        return RedisExampleDatabase(redis_client(database))
    return DirectoryBasedExampleDatabase(str(database or local))
