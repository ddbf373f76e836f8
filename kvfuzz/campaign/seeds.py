"""A guided campaign's seed pool: every program that reached coverage no earlier program of the campaign had, kept
with its configuration, so that later batches mutate it (:mod:`kvfuzz.campaign.scheduler.guided`).

Seeds are files in the corpus's campaign directory (``CORPUS/.kvfuzz-campaign/seeds/``), one JSON file each, named
by the digest of its content: a later campaign on the corpus starts from them, and every worker of a campaign reads
the others' (:meth:`SeedPool.refresh`). With ``--database redis://...`` each seed is also stored in the Redis hash
:data:`REDIS_SEEDS`, and the pool reads the seeds other machines stored there. A seed is data, not code: its
``config`` and ``program`` are the target's JSON (a scheduler trace's configuration and program), checked by the
target when it is run.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any, Optional

import attrs

SEED_FORMAT = "kvfuzz-seed/1"
SEED_DIRECTORY = "seeds"
"""Under the corpus's campaign directory."""
REDIS_SEEDS = "kvfuzz:seeds"
"""The Redis hash a campaign with ``--database`` shares its seeds in: seed digest -> the seed's JSON."""
MAX_SEED_BYTES = 1 << 20


@attrs.frozen
class Seed:
    """A kept program: the target's name, its configuration (the swarm row values, as JSON), its program (JSON
    operations), and how many points it reached first."""

    target: str
    config: dict[str, Any] = attrs.field(eq=False, hash=False)
    program: tuple[dict[str, Any], ...] = attrs.field(eq=False, hash=False)
    gain: int = attrs.field(eq=False, hash=False)
    digest: str = ""

    @classmethod
    def of(cls, target: str, config: dict[str, Any], program: list[dict[str, Any]], gain: int) -> Seed:
        text = json.dumps([target, config, program], sort_keys=True)
        return cls(target, config, tuple(program), gain, hashlib.sha256(text.encode()).hexdigest()[:16])

    @property
    def config_key(self) -> str:
        """Identifies the configuration (the bandit's arm)."""
        return json.dumps(self.config, sort_keys=True)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SEED_FORMAT,
            "target": self.target,
            "config": self.config,
            "program": list(self.program),
            "gain": self.gain,
        }

    @classmethod
    def from_json(cls, data: Any) -> Optional[Seed]:
        """The seed ``data`` holds, or None when it is not one (another format, a field missing)."""
        if not isinstance(data, dict) or data.get("format") != SEED_FORMAT:
            return None
        try:
            return cls.of(str(data["target"]), dict(data["config"]), list(data["program"]), int(data["gain"]))
        except (KeyError, TypeError, ValueError):
            return None


class SeedPool:
    """The seeds of one target in ``directory`` (and in Redis ``database``, when one is given)."""

    def __init__(self, directory: Path, target: str, database: Optional[str] = None) -> None:
        self.directory = directory
        self.target = target
        self.database = database
        self.seeds: dict[str, Seed] = {}
        self._read: set[str] = set()  # file names read already
        self.problem: Optional[str] = None  # why the last write failed, for the campaign to say once

    def __len__(self) -> int:
        return len(self.seeds)

    def add(self, seed: Seed) -> None:
        """Keep ``seed``: in memory, as a file (written whole: a temporary file renamed), and in Redis."""
        self.seeds[seed.digest] = seed
        name = f"{seed.target}-{seed.digest}.json"
        self._read.add(name)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(prefix=".seed-", suffix=".tmp", dir=self.directory)
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                json.dump(seed.to_json(), stream)
            os.replace(temporary, self.directory / name)
        except OSError as error:
            self.problem = f"seed not written to {self.directory}: {error.strerror or error}"
        if self.database is not None:
            try:
                from kvfuzz.campaign.cluster import redis_client

                redis_client(self.database).hset(REDIS_SEEDS, seed.digest, json.dumps(seed.to_json()))
            except Exception as error:  # noqa: BLE001 -- the server failing mid-campaign: said, the file stays
                self.problem = f"seed not stored in {self.database}: {' '.join(str(error).split())}"

    def refresh(self) -> int:
        """Read the seeds other workers (and earlier campaigns, and other machines through Redis) kept since the last
        refresh; returns how many were new."""
        before = len(self.seeds)
        try:
            names = sorted(path.name for path in self.directory.glob(f"{self.target}-*.json"))
        except OSError:
            names = []
        for name in names:
            if name in self._read:
                continue
            self._read.add(name)
            try:
                path = self.directory / name
                if path.stat().st_size <= MAX_SEED_BYTES:
                    self._keep(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError):
                continue
        if self.database is not None:
            try:
                from kvfuzz.campaign.cluster import redis_client

                for key, value in redis_client(self.database).hgetall(REDIS_SEEDS).items():
                    if key.decode() not in self.seeds and len(value) <= MAX_SEED_BYTES:
                        self._keep(json.loads(value))
            except Exception as error:  # noqa: BLE001 -- as in add()
                self.problem = f"seeds not read from {self.database}: {' '.join(str(error).split())}"
        return len(self.seeds) - before

    def _keep(self, data: Any) -> None:
        seed = Seed.from_json(data)
        if seed is not None and seed.target == self.target:
            self.seeds[seed.digest] = seed

    def choose(self, rng: random.Random, config_key: Optional[str] = None) -> Optional[Seed]:
        """A seed (of configuration ``config_key`` when given), those that reached more first drawn more often;
        None when there is none."""
        candidates = [seed for seed in self.seeds.values() if config_key is None or seed.config_key == config_key]
        if not candidates:
            return None
        candidates.sort(key=lambda seed: seed.digest)  # the draw depends on the seeds, not on the order read
        return rng.choices(candidates, weights=[1 + seed.gain for seed in candidates])[0]

    def drop(self, seed: Seed) -> None:
        """Forget ``seed`` in this worker (the target refused it here: another engine version's, say)."""
        self.seeds.pop(seed.digest, None)
