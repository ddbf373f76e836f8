"""The allocator target of a campaign (:class:`~kvfuzz.campaign.protocol.CampaignTarget`): its workers search the
allocators under swarmed configurations (:mod:`kvfuzz.campaign.worker`); the corpus's allocator traces (and, with
Redis, the findings stored there under an earlier signature's key) are its known findings."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

import attrs

import kvfuzz
from kvfuzz.campaign.cluster import ClusterFindings, is_redis
from kvfuzz.campaign.known import known_signatures, stored_findings_known
from kvfuzz.campaign.protocol import Settings, WorkerContext, worker_seed
from kvfuzz.campaign.rerun import Rerun
from kvfuzz.campaign.swarm import Limits
from kvfuzz.campaign.worker import HYPOTHESIS_EVERY, WorkerPlan, _Worker
from kvfuzz.engine.config import MachineConfig
from kvfuzz.program.safeguards import DEFAULT_CALL_TIMEOUT
from kvfuzz.shrink.signature import Signature


@attrs.frozen
class CampaignOptions:
    """What one campaign runs: the allocators (each probed into :class:`Limits`), how many workers, when it ends,
    where it saves, and what it shares."""

    allocators: tuple[str, ...]  # specs
    limits: tuple[Limits, ...]  # one per allocator, in the same order
    workers: int
    corpus: Path  # where new traces are saved (and the workers' journals kept)
    duration: Optional[float] = None  # seconds; None: no limit
    max_examples: Optional[int] = None  # programs to start, all workers together; None: no limit
    stop_after: Optional[int] = None  # new distinct failures; None: no limit
    known: tuple[Path, ...] = ()  # corpus directories whose traces' signatures are known findings
    database: Optional[str] = None  # redis://host:port/N, or an example-database directory
    seed: int = 0  # the campaign's seed: each worker's stream derives from it
    call_timeout: Optional[float] = DEFAULT_CALL_TIMEOUT
    shrink_seconds: float = 30.0
    base: MachineConfig = MachineConfig()  # model shape and kernel; the geometry is swarmed
    hypothesis_every: int = HYPOTHESIS_EVERY


class AllocatorCampaign:
    """The allocator target (see the module)."""

    def __init__(self, options: CampaignOptions) -> None:
        self.options = options
        self.settings = Settings.of(options)

    def prepare(self, event: Callable[[str], None]) -> dict[str, str]:
        options = self.options
        timeout = options.call_timeout or 60.0
        known = known_signatures([*options.known, options.corpus], options.allocators, timeout)
        if is_redis(options.database):  # findings stored under an earlier signature's key: known under today's
            assert options.database is not None
            stale = stored_findings_known(ClusterFindings(options.database), options.allocators, timeout)
            known = {**stale, **known}
        return known

    def seed_of(self, slot: int, incarnation: int) -> int:
        return worker_seed(self.options.seed, slot, incarnation)

    def search(self, worker: WorkerContext) -> None:
        options = self.options
        plan = WorkerPlan(
            worker.slot,
            worker.seed,
            options.allocators,
            options.limits,
            options.base,
            options.corpus,
            options.database,
            worker.state,
            worker.known,
            options.call_timeout,
            options.shrink_seconds,
            options.hypothesis_every,
            worker.claims,
            options.seed,
        )
        _Worker(plan, worker).search()

    def text(self, signature: dict[str, Optional[str]]) -> str:
        text = str(Signature(**signature))  # type: ignore[arg-type]  # Signature.to_json()'s fields
        return f"{text} [{signature['allocator']}]" if len(self.options.allocators) > 1 else text

    def rerun(self) -> Rerun:
        """The settings of a campaign run with these options in this directory, by this kvfuzz."""
        options = self.options
        return Rerun(
            options.allocators,
            options.seed,
            options.workers,
            options.duration,
            options.max_examples,
            options.stop_after,
            str(options.corpus),
            tuple(map(str, options.known)),
            options.database,
            options.shrink_seconds,
            options.call_timeout,
            os.getcwd(),
            kvfuzz.__version__,
        )

    def result_fields(self) -> dict[str, Any]:
        return {"allocators": self.options.allocators}
