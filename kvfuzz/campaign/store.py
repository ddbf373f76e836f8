"""Where a campaign's workers share what they found: the store of failure signatures and Hypothesis's example
database, in a local directory (the default) or in one Redis shared by workers on several machines.

A signature is *claimed* by the first worker that meets it, atomically (a file created exclusively, or Redis's
``HSETNX``): that worker shrinks and saves it; every other worker, on this machine or another, only counts it. The
example database holds the failing examples of the Hypothesis rounds, so that each is replayed first everywhere.
What lives in Redis, and how it is reached, is :mod:`kvfuzz.campaign.cluster`'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Protocol

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from kvfuzz.campaign.cluster import RedisStore, is_redis, redis_client
from kvfuzz.shrink.signature import Signature


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
